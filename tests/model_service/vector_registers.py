"""Which functions of a native extension touch which vector registers, from its disassembly: the
tests that check each ISA path's instructions stay in that path's own code (setup.py builds each
path with its own flags), so that the dispatcher and the portable path run on any x86-64 CPU."""
from __future__ import annotations

import re
import shutil
import subprocess

# A register's instructions may appear only in functions whose names hold one of these.
ALLOWED = {"zmm": ("avx512",), "ymm": ("avx2", "avx512")}


def objdump_available() -> bool:
    return shutil.which("objdump") is not None


def owners(path: str) -> dict[str, set[str]]:
    """register -> the (demangled) functions of the shared object at `path` that use it."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path],
                             capture_output=True, text=True, check=True).stdout
    found: dict[str, set[str]] = {register: set() for register in ALLOWED}
    function = ""
    for line in listing.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            function = head.group(1)
        for register in found:
            if "%" + register in line:
                found[register].add(function)
    return found


def assert_only_in_their_paths(found: dict[str, set[str]]) -> None:
    for register, functions in found.items():
        stray = sorted(f for f in functions if not any(name in f for name in ALLOWED[register]))
        assert not stray, (register, stray[:5])
