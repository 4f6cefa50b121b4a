"""Kernel object files, compiled once: the builders keep each kernel's machine code, and the
executable links it instead of compiling the kernel again.

A builder exports every kernel it measures as a shared library for the timer; exporting writes the
kernel's object file first, and `export_keeping` copies that file into a directory beside the
profile database (`Options.object_cache`), named by `object_key`: the scheduled PrimFunc's
structural hash, the target and the code that compiles it. The emitter schedules each plan kernel
as it was measured; where the directory holds its key, the Relax module calls the kernel as an
external function and the object is linked into the executable (`renamed`: its entry symbol
renamed to the call's), so the executable runs the very machine code that was timed. A kernel
without an object (measured by an earlier version, or its file pruned) is compiled in the module
as before.

Every kernel of a static plan links (the transformer block at seq=128, Zen 4: emit 0.2-0.6 s
against 0.8). Over a range a kernel with row copies is measured as built for its sample lengths
only (`schedule`'s `at`: half the build), which is not the code the executable needs for every
length, so those are built again whole (5 of that block's 12 kernels over seq=1..512 link): by
the run's builder processes before the emit (`pipeline.emit`, `measure.build_objects`), else each
alone into an object of its own, side by side (`build.compile_objects`), and linked like the others.

Finding a kernel's object by its scheduled module means scheduling the kernel again, which over a
range took longer than linking: 0.1-0.45 s a kernel in Python (an attention's row and narrow-key
copies), gpt_like's 50 kernels over seq=1..512 scheduled again in every executable the range's
dispatch emits (three or four). So each object is also named by what it was scheduled from
(`remember`, `known`): the lowered module's structural hash, the schedule, the bounds, the target
and every source file of kernorch (`package_digest`: the schedule rules, the tiles and the passes
are all in it); the emitter links that object without scheduling. A build for its sample lengths
only (a tile, whose `at` may drop copies) is named apart, with those lengths (SAMPLED): the
executable that is saved needs the whole kernel, and only one run at those lengths alone may link
it (the screening of a range's own plans at their samples: kernorch.executed.screen_samples).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

import tvm
import tvm_ffi

from . import passes, tirwalk

log = logging.getLogger(__name__)

OBJECTS_KEPT = 4096  # object files a directory keeps, the least recently used dropped beyond
ENTRY = "__tvm_ffi_main"  # the symbol of a kernel built alone (its PrimFunc is "main")


@functools.lru_cache(maxsize=1)
def code_parts() -> tuple[str, ...]:
    """What compiled code depends on besides its module and target: TVM and the TIR pipeline's code."""
    return (tvm.__version__, Path(passes.__file__).read_text(), Path(tirwalk.__file__).read_text())


def object_key(mod: tvm.IRModule, target) -> str:
    """The name of a scheduled kernel module's object file."""
    h = hashlib.sha256()
    for part in (str(tvm_ffi.structural_hash(mod)), str(target), *code_parts()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def object_path(directory: str | Path, mod: tvm.IRModule, target) -> Path:
    return Path(directory) / f"{object_key(mod, target)}.o"


SCHEDULED = "scheduled"  # the subdirectory naming each object by what it was scheduled from
SAMPLED = "sampled"      # ... and each built for some lengths only, with those lengths


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """A digest of every source file of the kernorch package: what scheduling a lowered kernel can
    depend on (a change anywhere in it names every kernel anew)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _entry(directory: str | Path, lowered: tvm.IRModule, mode: str, bounds, target, kind: str = SCHEDULED) -> Path:
    h = hashlib.sha256()
    # (free variables mapped by their order: a tile's copies at fixed lengths name the length's
    # variable in an attribute, where it is free and would otherwise hash by its address)
    for part in (str(tvm_ffi.structural_hash(lowered, map_free_vars=True)), mode,
                 json.dumps(sorted((bounds or {}).items())), str(target), *code_parts(), package_digest()):
        h.update(part.encode() + b"\0")
    return Path(directory) / kind / h.hexdigest()[:32]


def remember(directory: str | Path, lowered: tvm.IRModule, mode: str, bounds, target, obj: str | Path,
             lengths=None) -> None:
    """Record that `lowered` (a kernel's module before scheduling), scheduled in `mode` for `bounds`
    (over every length up to them; with `lengths`, for those alone: schedule's `at`), compiles to
    the object `obj` of `directory`."""
    entry = _entry(directory, lowered, mode, bounds, target, SAMPLED if lengths else SCHEDULED)
    text = Path(obj).name + ("\n" + ",".join(str(int(n)) for n in sorted(lengths)) if lengths else "")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, entry)
    except OSError as e:
        log.debug("could not name the object %s by its lowered module: %s", obj, e)


def _named(entry: Path) -> tuple[str, set[int]] | None:
    """An entry's object file name and the lengths it was built for (empty: every length)."""
    try:
        name, _, lengths = entry.read_text().strip().partition("\n")
        return name, {int(n) for n in lengths.split(",") if n}
    except (OSError, ValueError):
        return None


def known(directory: str | Path, lowered: tvm.IRModule, mode: str, bounds, target, at=None) -> Path | None:
    """The object of `directory` that `remember` recorded for this kernel, when it is still there:
    the whole kernel's, else with `at` (the only lengths it will run at) one built for lengths
    that hold them all."""
    for kind in (SCHEDULED, SAMPLED) if at else (SCHEDULED,):
        named = _named(_entry(directory, lowered, mode, bounds, target, kind))
        if named is None:
            continue
        name, lengths = named
        if lengths and not lengths >= set(at):  # (a whole kernel's name holds no lengths)
            continue
        obj = Path(directory) / name
        if name.endswith(".o") and "/" not in name and obj.exists():
            return obj
    return None


def available() -> bool:
    """Whether objects can be linked here: renaming their entry needs binutils' objcopy."""
    return shutil.which("objcopy") is not None


def link_shared(output: str, objects: list[str], options=None, **kwargs) -> None:
    """Link a kernel's object files into a shared library as `export_library`'s `fcompile`: with
    binutils' ld alone where every input is an object (nothing to compile), else TVM's C++ compiler
    driver. The driver's passes add nothing a kernel needs (no library: its few undefined symbols,
    TVM's error functions, resolve against the process that loads it, as they did before) and cost
    17 ms a kernel against 2 (Zen 2: 132 kernels of the transformer block over seq=1..512 linked in
    2.4 s, a sixth of their export)."""
    ld = shutil.which("ld")
    if ld is None or options or not all(str(o).endswith(".o") for o in objects):
        from tvm.support import cc
        return cc.create_shared(output, objects, options, **kwargs)
    r = subprocess.run([ld, "-shared", "-o", output, *map(str, objects)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"linking {output}: {r.stderr.strip()}")


def export_keeping(executable, path: str, keep_as: str | Path | None) -> None:
    """Export a kernel's compiled module as the shared library `path` (`link_shared`); with
    `keep_as`, keep the object file the export wrote (written under a temporary name, then
    renamed: a concurrent builder of the same kernel writes the same bytes)."""
    if keep_as is None:
        executable.export_library(path, fcompile=link_shared)
        return
    with tempfile.TemporaryDirectory(prefix="kernorch-obj-") as ws:
        executable.export_library(path, workspace_dir=ws, fcompile=link_shared)
        obj = Path(ws) / "lib0.o"
        if not obj.exists():
            return
        keep_as = Path(keep_as)
        try:
            keep_as.parent.mkdir(parents=True, exist_ok=True)
            tmp = keep_as.with_name(f".{keep_as.name}.{os.getpid()}")
            shutil.copyfile(obj, tmp)
            os.replace(tmp, keep_as)
        except OSError as e:
            log.warning("could not keep the kernel's object in %s: %s", keep_as.parent, e)


def renamed(objects: Mapping[str, Path], workspace: str | Path) -> list[str]:
    """Copies of `objects` ({call name: object file}) in `workspace`, each kernel's entry renamed to
    its call name's symbol (the Relax VM looks a call up by it), for `export_library(addons=...)`."""
    out = []
    for name, obj in objects.items():
        dst = Path(workspace) / f"{name}.o"
        r = subprocess.run(["objcopy", f"--redefine-sym={ENTRY}=__tvm_ffi_{name}", str(obj), str(dst)],
                           capture_output=True, text=True)
        if r.returncode != 0 or f"__tvm_ffi_{name}".encode() not in dst.read_bytes():
            raise RuntimeError(f"objcopy {obj}: {r.stderr.strip() or f'no {ENTRY} to rename'}")
        out.append(str(dst))
        os.utime(obj)  # used: the pruning keeps it
    return out


def prune(directory: str | Path) -> None:
    """Drop the least recently used object files beyond OBJECTS_KEPT."""
    kept = [q for q in Path(directory).glob("*.o") if not q.name.startswith(".")]
    if len(kept) <= OBJECTS_KEPT:
        return
    for old in sorted(kept, key=lambda q: q.stat().st_mtime, reverse=True)[OBJECTS_KEPT:]:
        old.unlink(missing_ok=True)
    for kind in (SCHEDULED, SAMPLED):  # names of objects no longer there
        for entry in (Path(directory) / kind).glob("*"):
            named = _named(entry)
            if named is not None and not (Path(directory) / named[0]).exists():
                entry.unlink(missing_ok=True)
