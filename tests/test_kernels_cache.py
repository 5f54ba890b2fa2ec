"""The CPU scan kernel's cache (issue 35): native code is built and loaded only from a directory the user alone
controls; anything else is refused with a warning, never loaded, and the torch reference is used."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from adjoint_compile.ops import linear_scan
from adjoint_compile.errors import AdjointCompileWarning
from adjoint_compile.kernels import scan as K
from adjoint_compile.kernels.scan import cpu
from adjoint_compile.kernels.scan import ref

needs_cc = pytest.mark.skipif(cpu._compiler() is None, reason="needs a C compiler")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel module with its load state reset (restored afterwards, so other tests keep the real kernel), the
    cache location taken from the environment this test sets, and ctypes.CDLL recorded."""
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)
    for var in ("ADJOINT_COMPILE_CACHE_DIR", "XDG_CACHE_HOME", "ADJOINT_COMPILE_CPU_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    loaded = []
    real_cdll = cpu.ctypes.CDLL

    def recording_cdll(path, *args, **kwargs):
        loaded.append(path)
        return real_cdll(path, *args, **kwargs)

    monkeypatch.setattr(cpu.ctypes, "CDLL", recording_cdll)
    monkeypatch.setattr(cpu, "loaded", loaded, raising=False)   # the paths handed to CDLL, for the tests
    return cpu


def _private_dir(path):
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    return path


def _assert_refused(kernel, match):
    """The kernel is refused with a warning naming ``match`` and the fix; nothing was loaded; scans still work."""
    with pytest.warns(AdjointCompileWarning, match=match) as rec:
        assert not kernel.available()
    msg = str(rec[0].message)
    assert "chmod 700" in msg and "ADJOINT_COMPILE_CACHE_DIR" in msg and "reference" in msg
    assert "refusing" in kernel.why_unavailable()
    assert kernel.loaded == []
    assert K.resolve_impl(None, torch.device("cpu")) == "reference"
    a, b = torch.rand(2, 9, 3), torch.randn(2, 9, 3)
    torch.testing.assert_close(linear_scan(a, b), ref.naive_scan(a, b))
    assert kernel.loaded == []


def _check_kernel_matches_reference(kernel):
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 100, 7, generator=g), torch.randn(2, 100, 7, generator=g)
    h0 = torch.randn(2, 7, generator=g)
    for reverse in (False, True):
        torch.testing.assert_close(kernel.scan_cpu(a, b, h0, 1, reverse), ref.scan_ref(a, b, h0, 1, reverse),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kernel.scan_cpu(a, b, None, 1, reverse), ref.naive_scan(a, b, None, 1, reverse),
                                   atol=1e-5, rtol=1e-5)


def _built(d):
    """The shared objects in ``d`` (and that no source or temporary file was left behind)."""
    names = sorted(os.listdir(d))
    assert all(n.endswith(".so") for n in names), names
    return names


@needs_cc
def test_a_world_writable_cache_directory_is_refused(kernel, tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir()
    d.chmod(0o777)
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    _assert_refused(kernel, "writable by group or others")
    assert str(d) in kernel.why_unavailable()
    assert os.listdir(d) == []                       # nothing was built into it either


@needs_cc
def test_a_group_writable_shared_object_is_refused(kernel, tmp_path, monkeypatch):
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    so = d / f"scan_{kernel._key(kernel._compiler())}.so"
    so.write_bytes(b"planted")
    so.chmod(0o664)
    _assert_refused(kernel, "writable by group or others")
    assert so.read_bytes() == b"planted"


@needs_cc
def test_a_cache_file_owned_by_another_user_is_refused(kernel, tmp_path, monkeypatch):
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    # a genuine kernel, private by its mode, but (as the owner check sees it) owned by someone else
    assert kernel.available()
    (so_name,) = _built(d)
    so = str(d / so_name)
    monkeypatch.setattr(kernel, "_lib", None)
    monkeypatch.setattr(kernel, "_failed", None)
    kernel.loaded.clear()
    real_lstat = os.lstat
    other = os.getuid() + 1

    def lstat(path, *args, **kwargs):
        st = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == so:
            fields = list(st[:10])
            fields[stat.ST_UID] = other
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(kernel.os, "lstat", lstat)
    _assert_refused(kernel, f"owned by uid {other}")


@needs_cc
def test_a_cache_directory_owned_by_another_user_is_refused(kernel, tmp_path, monkeypatch):
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    other = os.getuid() + 1
    monkeypatch.setattr(kernel.os, "getuid", lambda: other)     # everything on disk is now "someone else's"
    _assert_refused(kernel, "not by the current user")
    assert os.listdir(d) == []


@needs_cc
def test_a_symlinked_shared_object_is_refused(kernel, tmp_path, monkeypatch):
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    # a real, private kernel elsewhere; the cache's .so only points at it
    elsewhere = _private_dir(tmp_path / "elsewhere")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(elsewhere))
    assert kernel.available()
    (so_name,) = _built(elsewhere)
    monkeypatch.setattr(kernel, "_lib", None)
    monkeypatch.setattr(kernel, "_failed", None)
    kernel.loaded.clear()
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    os.symlink(elsewhere / so_name, d / so_name)
    _assert_refused(kernel, "symbolic link")


@needs_cc
def test_symlinks_at_predictable_source_paths_are_not_followed(kernel, tmp_path, monkeypatch):
    d = _private_dir(tmp_path / "cache")
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    before = victim.stat()
    key = kernel._key(kernel._compiler())
    # every name the source or the compiler output ever had, or that a guess would give
    planted = [f"scan_{key}.c", f"scan_{key}.so.{os.getpid()}.tmp", f"scan_{key}.so.tmp", "scan.c", "scan.so.tmp"]
    for name in planted:
        os.symlink(victim, d / name)
    assert kernel.available(), kernel.why_unavailable()
    assert victim.read_text() == "precious"
    assert victim.stat().st_mtime_ns == before.st_mtime_ns and stat.S_IMODE(victim.stat().st_mode) == \
        stat.S_IMODE(before.st_mode)
    for name in planted:                             # left alone, still pointing at the victim
        assert os.path.islink(d / name) and os.readlink(d / name) == str(victim)
    assert kernel.loaded == [str(d.resolve() / f"scan_{key}.so")]
    _check_kernel_matches_reference(kernel)


@needs_cc
def test_the_override_variable_moves_the_cache(kernel, tmp_path, monkeypatch):
    d = tmp_path / "not" / "yet" / "there"
    monkeypatch.setenv("ADJOINT_COMPILE_CACHE_DIR", str(d))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))     # the override wins
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel.available(), kernel.why_unavailable()
    (so_name,) = _built(d)
    assert kernel.loaded == [str(d.resolve() / so_name)]
    for p in (d, d.parent, d.parent.parent):                         # the directories it created: 0700
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert stat.S_IMODE((d / so_name).stat().st_mode) & 0o022 == 0
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()
    _check_kernel_matches_reference(kernel)
    # a second process (fresh state) loads the cached kernel without building
    monkeypatch.setattr(kernel, "_lib", None)
    monkeypatch.setattr(kernel, "_failed", None)
    monkeypatch.setattr(kernel.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a cached kernel"))
    assert kernel.available()
    assert kernel.loaded == [str(d.resolve() / so_name)] * 2


@needs_cc
def test_xdg_cache_home_is_honored(kernel, tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel.available(), kernel.why_unavailable()
    d = xdg / "adjoint_compile"
    (so_name,) = _built(d)
    assert kernel.loaded == [str(d.resolve() / so_name)]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(xdg.stat().st_mode) == 0o700
    assert not (tmp_path / "home").exists()
    _check_kernel_matches_reference(kernel)


@needs_cc
def test_without_xdg_the_cache_is_under_home(kernel, tmp_path, monkeypatch):
    home = _private_dir(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")         # the XDG spec: only absolute paths count
    assert kernel.available(), kernel.why_unavailable()
    d = home / ".cache" / "adjoint_compile"
    (so_name,) = _built(d)
    assert kernel.loaded == [str(d.resolve() / so_name)]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    assert kernel._cache_dir() == str(d) and not (tmp_path / "relative").exists()
