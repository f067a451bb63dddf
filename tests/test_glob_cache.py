"""GlobCache: the same matches as glob.glob, listing folders again only
when they change."""

import glob
import os
import time

from mmtrace.agent.discovery.glob_cache import RACY_NS, GlobCache


def settle(*folders):
    """Date folders' mtimes a minute back: past the racy window."""
    past = time.time() - 60
    for folder in folders:
        os.utime(folder, (past, past))


def test_unchanged_folders_are_not_listed_again(tmp_path):
    lib = tmp_path / "cuda-12" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.12").touch()
    (lib / "libother.so").touch()
    settle(tmp_path, tmp_path / "cuda-12", lib)
    cache = GlobCache()
    pattern = f"{tmp_path}/cuda*/lib64/libcudart.so*"
    assert cache.glob(pattern) == [str(lib / "libcudart.so.12")] == glob.glob(pattern)
    for _ in range(5):
        assert cache.glob(pattern) == [str(lib / "libcudart.so.12")]
    assert cache.listings == 1


def test_a_new_file_a_removed_file_and_a_new_folder_are_seen(tmp_path):
    (tmp_path / "cuda-12" / "lib64").mkdir(parents=True)
    settle(tmp_path, tmp_path / "cuda-12", tmp_path / "cuda-12" / "lib64")
    # Every change below is past the racy window, however slow this host:
    # a folder is listed again only for its moved mtime.
    cache = GlobCache(clock_ns=lambda: time.time_ns() + 2 * RACY_NS)
    pattern = f"{tmp_path}/cuda*/lib64/libcudart.so*"
    assert cache.glob(pattern) == []
    new = tmp_path / "cuda-12" / "lib64" / "libcudart.so.12"
    new.touch()                                     # the folder's mtime moves
    assert cache.glob(pattern) == [str(new)]
    settle(new.parent)
    assert cache.glob(pattern) == [str(new)]
    listed = cache.listings
    (tmp_path / "cuda-13" / "lib64").mkdir(parents=True)
    other = tmp_path / "cuda-13" / "lib64" / "libcudart.so.13"
    other.touch()
    assert cache.glob(pattern) == sorted([str(new), str(other)])
    new.unlink()
    assert cache.glob(pattern) == [str(other)]
    assert cache.listings == listed + 2


def test_a_missing_folder_is_watched_through_its_deepest_existing_parent(tmp_path):
    settle(tmp_path)
    cache = GlobCache()
    pattern = f"{tmp_path}/Ascend/latest/lib64/*.so*"
    assert cache.glob(pattern) == []
    assert cache.glob(pattern) == [] and cache.listings == 1
    lib = tmp_path / "Ascend" / "latest" / "lib64"
    lib.mkdir(parents=True)                         # tmp_path's mtime moves
    (lib / "libascendcl.so").touch()
    assert cache.glob(pattern) == [str(lib / "libascendcl.so")]


def test_a_folder_changed_within_the_racy_window_is_listed_again(tmp_path):
    (tmp_path / "libcuda.so.1").touch()             # tmp_path changed just now
    changed = os.stat(tmp_path).st_mtime_ns
    cache = GlobCache(clock_ns=lambda: changed + RACY_NS // 2)   # however slow this host
    pattern = f"{tmp_path}/libcuda.so*"
    assert cache.glob(pattern) == [str(tmp_path / "libcuda.so.1")]
    assert cache.glob(pattern) == [str(tmp_path / "libcuda.so.1")]
    assert cache.listings == 2                      # not trusted yet


def test_forget_drops_patterns_no_longer_used(tmp_path):
    settle(tmp_path)
    cache = GlobCache()
    a, b = f"{tmp_path}/a*", f"{tmp_path}/b*"
    cache.glob(a), cache.glob(b)
    cache.forget({a})
    cache.glob(a), cache.glob(b)
    assert cache.listings == 3                      # b listed again, a not
