"""Point an MLX that is already loaded at OpenBLAS (Linux): the late-import path of
`toymlx.backend.device.preload_blas`.

Why: MLX's Linux wheel links a reference BLAS. `import toymlx` before `mlx.core` puts OpenBLAS
in the process's global symbol scope first, so MLX's calls resolve there (`toymlx.backend.device`). A
script that imported `mlx.core` or `mlx_lm` first (any mlx-lm user's) used to keep the reference
BLAS for the whole process: training steps 10-40x slower, decoding SmolLM2-135M 7.8 tokens/s
against 23.6 (AMD EPYC Zen 4, 2 cores), with no word of it.

How: `libmlx.so` calls every BLAS and LAPACK function through its procedure linkage table: one
function pointer per symbol in its `.got.plt`, which the dynamic loader fills at the first call
(lazy binding). `rebind` reads libmlx.so's relocation table from the file, finds the slots of
the functions the new BLAS provides, and writes the new addresses there: every later call goes
to OpenBLAS (and `cblas_sgemm` to `toymlx.backend.gemv_forward` where that is on), the same functions
the import-order path gives. A slot already bound to the reference BLAS by an earlier matmul is
rewritten too. A pointer-sized aligned store is atomic, so a matmul running on another thread
calls either the old or the new function, both complete. A slot in a read-only page (a library
linked with `-z now`) is not touched: `rebind` raises, and toymlx keeps the old warning.
`TOYMLX_BLAS=reference` leaves MLX's BLAS alone in every case (`toymlx.backend.device.preload_blas`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable

_JUMP_SLOT = {62: 7, 183: 1026}
_GLOB_DAT = {62: 6, 183: 1025}
"""The relocation types of a PLT slot and of a GOT entry (a function whose address the library
takes, called through the entry), by e_machine: x86-64, aarch64."""
"""e_machine -> the relocation type of a PLT slot: x86-64 (R_X86_64_JUMP_SLOT), aarch64
(R_AARCH64_JUMP_SLOT)."""
_SHT_RELA = 4
_SHT_SYMTAB = 2
_RTLD_DI_LINKMAP = 2


class _LinkMap(ctypes.Structure):  # the head of glibc's struct link_map
    _fields_ = [("l_addr", ctypes.c_size_t), ("l_name", ctypes.c_char_p)]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


_libc = ctypes.CDLL(None)


def plt_slots(path: str | os.PathLike, kinds: dict[int, int] = _JUMP_SLOT) -> dict[str, int]:
    """{symbol: offset of its PLT slot from the load base} of a 64-bit little-endian ELF shared
    library (with `kinds` `_GLOB_DAT`: of its GOT entries); raises OSError naming the file where
    it is not one or has no section headers."""
    with open(path, "rb") as f:  # mapped, not read: a 30 MB read and free would move glibc's
        # dynamic mmap threshold for the whole process (TOYMLX_MALLOC=default would not be)
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise OSError(f"{path}: expected a 64-bit little-endian ELF file") from None
    with data:
        return _slots(path, data, kinds)


def _slots(path: str | os.PathLike, data: mmap.mmap, kinds: dict[int, int]) -> dict[str, int]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError(f"{path}: expected a 64-bit little-endian ELF file")
    machine, = struct.unpack_from("<H", data, 0x12)
    if machine not in _JUMP_SLOT:
        raise OSError(f"{path}: expected an x86-64 or aarch64 library, found e_machine {machine}")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        raise OSError(f"{path}: no section headers to find its relocations in")
    # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, ...)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    slots: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_RELA:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]][4]
        for at in range(offset, offset + size - 23, 24):  # Elf64_Rela, read in place
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            symbol = r_info >> 32
            if r_info & 0xFFFFFFFF != kinds[machine] or symbol == 0:
                continue
            name_at = strtab + struct.unpack_from("<I", data, symtab[4] + symbol * 24)[0]
            slots[data[name_at:data.find(b"\0", name_at)].decode()] = r_offset
    return slots


def _mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, file) of each mapping of this process (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            out.append((lo, hi, perms, rest[-1].rstrip("\n") if len(rest) == 4 else ""))
    return out


def loaded_library(name: str) -> str | None:
    """The path of the loaded shared library called `name` (its file name)."""
    return next((path for *_, path in _mappings() if os.path.basename(path) == name), None)


def _load_base(path: str) -> int:
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    link = ctypes.POINTER(_LinkMap)()
    if _libc.dlinfo(ctypes.c_void_p(handle._handle), _RTLD_DI_LINKMAP, ctypes.byref(link)) != 0:
        raise OSError(f"{path}: dlinfo could not find its load address")
    return link.contents.l_addr


def library_of(address: int) -> str | None:
    """The file of the loaded object that contains `address` (dladdr)."""
    info = _DlInfo()
    if not address or _libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) == 0:
        return None
    return info.dli_fname.decode() if info.dli_fname else None


def slot_target(library: str, symbol: str) -> str | None:
    """The file whose code `library`'s PLT slot for `symbol` points at now: a BLAS once bound,
    `library` itself while the slot waits for its first call (lazy binding)."""
    path = loaded_library(library)
    if path is None:
        return None
    offset = plt_slots(path).get(symbol)
    if offset is None:
        return None
    return library_of(ctypes.c_void_p.from_address(_load_base(path) + offset).value or 0)


def rebind(library: str, target: Callable[[str], int | None]) -> list[str]:
    """Point the PLT slots of the loaded `library` (a file name: "libmlx.so") at `target(name)`
    for every symbol it gives an address for; return the rebound names. Raises OSError (the
    reason) where the library is not loaded, its relocations cannot be read, or a slot is in a
    read-only page; nothing is written then."""
    path = loaded_library(library)
    if path is None:
        raise OSError(f"{library} is not loaded in this process")
    base = _load_base(path)
    writable = [(lo, hi) for lo, hi, perms, _ in _mappings() if perms[1] == "w"]
    plan = []
    for name, offset in sorted(plt_slots(path).items()):
        address = target(name)
        if address:
            if not any(lo <= base + offset < hi for lo, hi in writable):
                raise OSError(f"{path}: the PLT slot of {name} is read-only (linked with -z now)")
            plan.append((name, base + offset, address))
    for _, slot, address in plan:
        ctypes.c_void_p.from_address(slot).value = address
    return [name for name, _, _ in plan]


def rebind_calls(library: str, addresses: dict[str, int]) -> None:
    """Point the loaded `library`'s calls of each {symbol: address} there, in the order given:
    its PLT slot, or, for a function whose address the library takes (a GOT entry: libmlx.so's
    `free`), that entry, whose page the loader made read-only (RELRO) and which is opened for
    the write and closed again. Raises OSError (the reason) where the library is not loaded, a symbol has
    neither, or a page cannot be opened; nothing is written then."""
    path = loaded_library(library)
    if path is None:
        raise OSError(f"{library} is not loaded in this process")
    base = _load_base(path)
    plt, got = plt_slots(path), plt_slots(path, _GLOB_DAT)
    plan = []
    for name, address in addresses.items():
        offset = plt.get(name, got.get(name))
        if offset is None:
            raise OSError(f"{path}: no PLT slot or GOT entry for {name}")
        plan.append((base + offset, address))
    pages = {slot & -mmap.PAGESIZE for slot, _ in plan}
    writable = [(lo, hi) for lo, hi, perms, _ in _mappings() if perms[1] == "w"]
    closed = [page for page in pages if not any(lo <= page < hi for lo, hi in writable)]
    mprotect = _libc.mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    read, write = 1, 2  # PROT_READ, PROT_WRITE
    for page in closed:
        if mprotect(page, mmap.PAGESIZE, read | write) != 0:
            raise OSError(f"{path}: its GOT page at {page:#x} cannot be made writable")
    try:
        for slot, address in plan:
            ctypes.c_void_p.from_address(slot).value = address
    finally:
        for page in closed:
            mprotect(page, mmap.PAGESIZE, read)


def symbol_offset(path: str | os.PathLike, name: str) -> int | None:
    """The offset from the load base of `name` in the ELF file's full symbol table (`.symtab`,
    which holds the library's local symbols too); None where the file has none or no such
    symbol (a stripped library)."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with data:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        wanted = name.encode()
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind != _SHT_SYMTAB:
                continue
            strtab = sections[link][4]
            for at in range(offset, offset + size - 23, 24):  # Elf64_Sym
                st_name, = struct.unpack_from("<I", data, at)
                start = strtab + st_name
                if data[start:start + len(wanted) + 1] == wanted + b"\0":
                    return struct.unpack_from("<Q", data, at + 8)[0]
    return None


def loaded_byte(library: str, offset: int) -> int:
    """The byte at `offset` from the loaded `library`'s base."""
    path = loaded_library(library)
    if path is None:
        raise OSError(f"{library} is not loaded in this process")
    return ctypes.c_uint8.from_address(_load_base(path) + offset).value
