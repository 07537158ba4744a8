"""A multi-part GGUF for tests, split as llama.cpp's gguf-split splits one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def split_gguf(src: Path, out: Path, per_part: int) -> list[Path]:
    """`src` split as llama.cpp's gguf-split splits it, by gguf-py's GGUFWriter (what
    convert_hf_to_gguf.py --split-max-tensors runs): `per_part` tensors a part, parts named
    `<out stem>-0000i-of-0000N.gguf`, the metadata in the first, split.* keys in each."""
    r = GGUFReader(str(src))
    w = GGUFWriter(None, r.fields["general.architecture"].contents(),
                   split_max_tensors=per_part)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture itself
        vtype = GGUFValueType(f.types[0])
        w.add_key_value(key, f.contents(), vtype,
                        sub_type=GGUFValueType(f.types[1]) if vtype == GGUFValueType.ARRAY
                        else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type,
                     raw_shape=[int(d) for d in reversed(t.shape)])
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = -(-len(r.tensors) // per_part)
    return [out.with_name(f"{out.stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
