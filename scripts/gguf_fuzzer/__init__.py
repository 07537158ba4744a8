"""A mutation fuzzer for every GGUF reader path of toymlx (run it as `scripts/fuzz_gguf.py`).

    doc.py         a GGUF file as an editable document (parse a seed, serialise any override)
    mutations.py   structure-aware and byte-level mutations; a case from (seed, index)
    seeds.py       the real files cases start from
    readers.py     toymlx's reader paths and the clean-error contract
    supervisor.py  cases in a guarded worker process; crashes, hangs, the summary
"""
