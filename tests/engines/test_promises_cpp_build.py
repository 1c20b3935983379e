"""The native engine's build, as its docstrings promise it, without compiling anything: what
``torch.utils.cpp_extension.load`` is handed (the name the cache key gives, csrc's sources,
the flags and constants, the link flags, the folder, quietly), the one-line reason and the
single warning when the engine cannot run (CAUSALATTN_NO_CPP, no compiler named by CXX, no
ninja, a failing build, an extension built with other constants), the progress line only
while something compiles, the constants as C++ literals, and the fresh folder a build from
nothing gets. ``load`` is replaced by a recorder; ``cpp._STATE`` is a fresh dict per test,
so nothing leaks into the rest of the suite."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from causalattn import constants
from causalattn.engines import cpp


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A build whose ``load`` only records what it is handed (and returns ``result``, or
    raises it when it is an exception); ninja and the compiler CXX names are there (a
    script: nothing is compiled), so no test depends on this machine's tools."""
    cxx = tmp_path / "c++"
    cxx.write_text("#!/bin/sh\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("CAUSALATTN_NO_CPP", raising=False)
    monkeypatch.setattr(cpp, "_STATE", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    rec = types.SimpleNamespace(calls=[], result=types.SimpleNamespace(**constants.SHARED))

    def load(**kw):
        rec.calls.append(kw)
        if isinstance(rec.result, BaseException):
            raise rec.result
        return rec.result

    monkeypatch.setattr(cpp_extension, "load", load)
    return rec


def _unavailable():
    """cpp.unavailable() and the engine's warnings it gave (RuntimeWarnings, each)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        why = cpp.unavailable()
    ours = [x for x in w if "engine 'cpp'" in str(x.message)]
    assert all(x.category is RuntimeWarning for x in ours)
    return why, [str(x.message) for x in ours]


def test_each_constant_is_a_cpp_literal_that_reads_back_exactly():
    """_literal: a double by its shortest repr, an integer as an unsigned hex."""
    assert cpp._literal(0.1) == "0.1" and cpp._literal(constants.LOG2E) == repr(constants.LOG2E)
    assert cpp._literal(0x9E3779B9) == "0x9e3779b9u" and cpp._literal(3) == "0x3u"
    for name, v in constants.SHARED.items():
        lit = cpp._literal(v)
        if isinstance(v, float):
            assert float(lit) == v and lit == repr(v), name
        else:
            assert re.fullmatch(r"0x[0-9a-f]+u", lit) and int(lit[:-1], 16) == v, name


def test_the_build_is_handed_its_key_named_sources_flags_constants_and_folder(build):
    """What the build compiles: csrc's C++ sources, under the name the cache key gives, with
    the flags build_info reports and every shared constant, linked with its ldflags, in the
    folder build_info names; quietly (torch's verbose mode prints the compiler's output and
    each load step). The loaded extension is the one the engine runs."""
    assert _unavailable() == ("", []) and _unavailable() == ("", [])  # built once
    (seen,) = build.calls
    info = cpp.build_info()
    assert seen["name"] == cpp.extension_name() == f"causalattn_cpp_{info['cache_key']}"
    assert seen["build_directory"] == info["folder"] and Path(info["folder"]).name == seen["name"]
    assert sorted(map(Path, seen["sources"])) == sorted(cpp.CSRC.glob("*.cpp"))
    flags = set(seen["extra_cflags"])
    assert set(info["flags"]) <= flags and set(cpp.DEFINES) <= flags
    assert {f.split("=")[0] for f in flags - set(info["flags"])} == {
        f"-DCAUSALATTN_{n}" for n in constants.SHARED
    }
    assert list(seen["extra_ldflags"]) == info["ldflags"]
    assert not seen.get("verbose")
    assert cpp._ops() is build.result


def test_causalattn_no_cpp_disables_the_engine_without_building_or_warning(build, monkeypatch):
    monkeypatch.setenv("CAUSALATTN_NO_CPP", "1")
    assert _unavailable() == ("engine 'cpp': disabled by CAUSALATTN_NO_CPP", [])
    assert build.calls == []
    with pytest.raises(ValueError, match="^engine 'cpp': disabled by CAUSALATTN_NO_CPP$"):
        cpp._ops()


def test_a_compiler_that_cxx_names_and_path_lacks_makes_it_unavailable(
    build, tmp_path, monkeypatch
):
    """The compiler is $CXX's: one that is not there is named in the one line, warned once."""
    missing = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", missing)
    why = f"engine 'cpp': no C++ compiler found ({missing!r} is not on PATH)"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert cpp.unavailable() == why
    (warned,) = w  # at whoever asked, not at a line of the engine's own
    assert warned.category is RuntimeWarning and str(warned.message) == (
        f"{why}; 'auto' runs the other engines"
    )
    assert Path(warned.filename).resolve() != Path(cpp.__file__).resolve()
    assert _unavailable() == (why, [])  # once
    assert build.calls == []


def test_without_ninja_the_engine_is_unavailable_and_says_how_to_get_it(build, monkeypatch):
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    why = "engine 'cpp': the ninja build tool is not installed (pip install ninja)"
    assert _unavailable() == (why, [f"{why}; 'auto' runs the other engines"])
    assert build.calls == []


def test_a_failing_build_is_the_compilers_first_error_and_no_extension(build):
    build.result = RuntimeError(
        "Error building extension 'causalattn_cpp_x':\n[1/3] c++ -c forward.cpp\n"
        "forward.cpp:12:3: error: boom\nbackward.cpp:1:1: error: later\nninja: build stopped"
    )
    why = "engine 'cpp': the C++ extension did not build: forward.cpp:12:3: error: boom"
    assert _unavailable() == (why, [f"{why}; 'auto' runs the other engines"])
    assert "ext" not in cpp._STATE
    with pytest.raises(ValueError, match="forward.cpp:12:3: error: boom$"):
        cpp._ops()


def test_an_extension_built_with_other_constants_is_refused_and_they_are_named(build):
    """An extension that lacks a constant or has another value would compute with other
    numbers: unavailable names each, in constants.SHARED's order."""
    other = dict(constants.SHARED, HASH_GOLD=constants.HASH_GOLD + 1)
    del other["LN2"]
    build.result = types.SimpleNamespace(**other)
    why = "engine 'cpp': the extension was built with other constants (LN2, HASH_GOLD)"
    assert _unavailable() == (why, [f"{why}; 'auto' runs the other engines"])
    with pytest.raises(ValueError, match=re.escape(why)):
        cpp._ops()


@pytest.mark.parametrize("built", [False, True])
def test_the_progress_line_shows_on_a_terminal_only_while_compiling(build, monkeypatch, built):
    """A first build shows its line on a terminal's stderr; loading one already built (its
    library in the folder) shows nothing."""
    name = cpp.extension_name()
    if built:
        (cpp.build_folder(cpp_extension, name) / f"{name}.so").touch()
    tty, err = _Tty(), sys.stderr
    try:
        sys.stderr = tty
        assert cpp.unavailable() == ""
    finally:
        sys.stderr = err
    assert (cpp.BUILDING in tty.getvalue()) is not built
    if built:
        assert tty.getvalue() == ""


def _fake_python(tmp_path, body: str) -> str:
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


def test_a_build_from_nothing_gets_an_empty_extension_folder_of_its_own(tmp_path, monkeypatch):
    """Not the caller's TORCH_EXTENSIONS_DIR (whose build is cached): a fresh, empty one."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "cached").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(mine))
    seen = tmp_path / "seen"
    body = f'echo "$TORCH_EXTENSIONS_DIR" > {seen}; test -d "$TORCH_EXTENSIONS_DIR" && '
    body += f'ls -A "$TORCH_EXTENSIONS_DIR" >> {seen}'
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, body))
    seconds, why = cpp.build_from_nothing()
    assert why == "" and seconds is not None
    listing = seen.read_text().splitlines()
    assert listing[0] not in ("", str(mine)) and listing[1:] == []
    assert not Path(listing[0]).exists()  # removed after


def test_a_build_from_nothing_reports_its_seconds_or_why_it_failed(tmp_path, monkeypatch):
    """Its seconds when the child says nothing is wrong, else (None, why): the child's error
    output, the timeout, or the engine's own one-line reason (the real child's last line)."""
    monkeypatch.delenv("CAUSALATTN_NO_CPP", raising=False)
    real = sys.executable
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "echo"))
    seconds, why = cpp.build_from_nothing()
    assert why == "" and isinstance(seconds, float) and 0 < seconds < 60
    failing = _fake_python(tmp_path, "echo ' a.cpp: error: no' >&2; exit 1")
    monkeypatch.setattr(sys, "executable", failing)
    assert cpp.build_from_nothing() == (None, "a.cpp: error: no")
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "exec sleep 5"))
    assert cpp.build_from_nothing(timeout_s=1.0) == (None, "no build within 1 s")
    monkeypatch.setattr(sys, "executable", real)
    monkeypatch.setenv("CAUSALATTN_NO_CPP", "1")
    assert cpp.build_from_nothing() == (None, "engine 'cpp': disabled by CAUSALATTN_NO_CPP")
    monkeypatch.delenv("CAUSALATTN_NO_CPP")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    seconds, why = cpp.build_from_nothing()
    assert seconds is None and why.startswith("engine 'cpp': no C++ compiler found")


def test_a_build_from_nothing_that_fails_says_why_in_at_most_300_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, f"echo {'e' * 400} >&2; exit 1"))
    assert cpp.build_from_nothing() == (None, "e" * 300)


def test_a_build_from_nothing_waits_900_seconds_by_default(monkeypatch):
    """The signature's default: a build that takes longer is reported as not done in 900 s."""
    given = {}

    def run(*args, timeout, **kw):
        given["timeout"] = timeout
        raise subprocess.TimeoutExpired(args[0], timeout)

    monkeypatch.setattr(subprocess, "run", run)
    assert cpp.build_from_nothing() == (None, "no build within 900 s")
    assert given["timeout"] == 900


CPUINFO = "processor\t: 0\nmodel name\t: {model}\ncpu MHz\t\t: {mhz}\nflags\t\t: {flags}\n"


def test_the_machine_tag_follows_the_architecture_model_and_flags(monkeypatch):
    """-march=native builds for this CPU: its tag follows the architecture, the model name
    and the flags in /proc/cpuinfo (not the clock, which moves); where that file cannot be
    read, the architecture and the processor platform names."""
    import builtins
    import platform

    real_open, cpu = builtins.open, {}

    def fake_open(path, *args, **kw):
        if path != "/proc/cpuinfo":
            return real_open(path, *args, **kw)
        if cpu["info"] is None:
            raise PermissionError(path)
        return io.StringIO(cpu["info"])

    monkeypatch.setattr(cpp, "open", fake_open, raising=False)
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")

    def tag(arch="x86_64", model="CPU A", flags="fpu sse2 avx2", mhz="2400.000"):
        monkeypatch.setattr(platform, "machine", lambda: arch)
        cpu["info"] = CPUINFO.format(model=model, mhz=mhz, flags=flags)
        return cpp._machine_tag()

    base = tag()
    assert re.fullmatch(r"[0-9a-f]+", base) and tag(mhz="3100.512") == base
    others = [tag(arch="aarch64"), tag(model="CPU B"), tag(flags="fpu sse2 avx2 avx512f")]
    assert len({base, *others}) == 4
    key = cpp.cache_key()
    tag(flags="fpu sse2")
    assert cpp.cache_key() != key  # another CPU, another build folder
    cpu["info"] = None  # no /proc/cpuinfo: the architecture and the processor
    unread = cpp._machine_tag()
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert len({unread, cpp._machine_tag(), base}) == 3


def test_the_cache_key_follows_every_source_and_header_byte(tmp_path, monkeypatch):
    """Editing any .cpp or header gives another key (another folder: never yesterday's
    binary); the same bytes give the same key."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(cpp.CSRC, csrc)
    monkeypatch.setattr(cpp, "CSRC", csrc)
    keys = [cpp.cache_key()]
    for name in ("forward.cpp", "problem.h"):
        src = csrc / name
        text = src.read_text()
        src.write_text(text + "// edited\n")
        keys.append(cpp.cache_key())
        src.write_text(text)
        assert cpp.cache_key() == keys[0]
    assert len(set(keys)) == 3
