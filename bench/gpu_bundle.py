"""What bench/gpu_check needs on a host with no package registry, gathered
here into one folder (`bench/gpu_check --bundle DIR`), and put to use
there (`bench/gpu_check --from-bundle DIR`).

The folder holds:
- bcc.tar.xz: Debian's bcc (libbcc.so.0 and its Python module, which is
  pure Python over libbcc) and every library libbcc needs but glibc's own,
  from Debian's packages (`apt-get download`, `dpkg -x`). LLVM 14 links
  libz3 (the Clang static analyzer's solver) and libxml2 (llvm-mt's
  manifests), which bcc never calls: in their place go stubs with their
  sonames and the symbols LLVM takes from them, each of which aborts with
  a message if it is ever called. That keeps the folder within 50 MiB (the
  two with ICU come to 14 MB more, compressed).
- headers.tar.xz: Debian's kernel headers (include/ and arch/x86/ of
  linux-headers-*-common, with the generated files of -amd64), for a host
  whose kernel ships none.
- wheels/: the pure-Python packages of requirements.txt (`pip download`);
  those with compiled code (numpy, lz4) are the host's own (without lz4
  the daemon's rings pack with zlib, at 1.5-2 times the CPU).
- MANIFEST.json and MANIFEST.txt: every file with its size and sha256, what
  each archive holds, the packages and versions, and the folder's size.

On the host, what it has comes first: the bundle fills in what it lacks.
bcc (libbcc, LLVM, Clang, the Python module) always comes from the bundle,
as one consistent set; any other library only where the host's loader
knows no library of that soname; a wheel only where its packages do not
import. The script sets LD_LIBRARY_PATH and PYTHONPATH and runs itself
again with them.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 50 * 2**20
ARCH_LIBS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
# Debian's packages of bcc and what libbcc.so.0 needs, but glibc itself.
BCC_PACKAGES = ("libbpfcc", "python3-bpfcc", "libclang-cpp14", "libllvm14", "libbpf1",
                "libelf1", "libedit2", "libbsd0", "libmd0", "libffi8", "libtinfo6", "zlib1g",
                "libstdc++6", "libgcc-s1")
# Needed by LLVM, never called by bcc: stubs in their place, made from the
# real package's symbols.
STUBBED = {"libz3.so.4": "libz3-4", "libxml2.so.2": "libxml2"}
GLIBC = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
         "ld-linux-x86-64.so.2"}
# Always from the bundle on the host: they must match one another.
ALWAYS_BUNDLED = ("libbcc.so.0", "libclang-cpp.so.14", "libLLVM-14.so.1")
PURE_WHEEL = ["--only-binary=:all:", "--no-deps", "--python-version", "3.12",
              "--implementation", "py", "--abi", "none", "--platform", "any"]


class BundleError(Exception):
    """The bundle could not be built or used; the message says why."""


def _run(cmd, cwd=None) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BundleError(f"{' '.join(map(str, cmd))} exited {result.returncode}: "
                          f"{(result.stderr or result.stdout).strip()[-600:]}")
    return result.stdout


def _need(tool: str):
    if shutil.which(tool) is None:
        raise BundleError(f"building the bundle needs {tool}, which is not on PATH")


# ----- building it (here) -------------------------------------------------------

def build(dest: Path, log=print) -> dict:
    """Gather everything into `dest` (replaced whole when the build
    succeeds); return the manifest."""
    for tool in ("apt-get", "dpkg", "apt-cache", "readelf", "gcc", "xz"):
        _need(tool)
    dest = Path(dest).resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        out = tmp / "bundle"
        out.mkdir()
        headers_packages = _headers_packages()
        debs = _download([*BCC_PACKAGES, *STUBBED.values(), *headers_packages], tmp / "debs",
                         log)
        unpacked = tmp / "root"
        for deb in debs.values():
            _run(["dpkg", "-x", deb, unpacked])
        stage = tmp / "stage"
        libs = _library_closure(unpacked, stage / "lib")
        stubs = {soname: _stub(unpacked, soname, [stage / "lib" / n for n in libs],
                               stage / "stubs")
                 for soname in STUBBED}
        shutil.copytree(unpacked / "usr/lib/python3/dist-packages/bcc", stage / "python/bcc")
        log("compressing bcc and its libraries (xz -9: minutes)")
        _tar_xz(stage, ["lib", "stubs", "python"], out / "bcc.tar.xz")
        headers = _merge_headers(unpacked, headers_packages, tmp / "headers")
        log("compressing the kernel headers")
        _tar_xz(tmp / "headers", [headers], out / "headers.tar.xz")
        wheels = _wheels(out / "wheels", log)
        manifest = _manifest(out, debs, libs, stubs, headers, wheels)
        if manifest["bytes"] > LIMIT_BYTES:
            raise BundleError(f"the bundle holds {manifest['bytes']:,} bytes, over the limit "
                              f"of {LIMIT_BYTES:,} (50 MiB): see {out}/MANIFEST.txt")
        old = dest.with_name(dest.name + ".old")
        if dest.exists():
            dest.rename(old)
        out.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def _headers_packages() -> list[str]:
    """Debian's headers for this architecture, as linux-headers-amd64 names
    them: the -amd64 package and the -common one it depends on."""
    arch = _run(["dpkg", "--print-architecture"]).strip()
    found = re.findall(rf"Depends: (linux-headers-[\w.-]+-{arch})\b",
                       _run(["apt-cache", "depends", f"linux-headers-{arch}"]))
    if not found:
        raise BundleError(f"apt-cache depends linux-headers-{arch} names no headers package")
    flavour = found[0]
    return [flavour, flavour[: -len(arch)] + "common"]


def _download(packages, where: Path, log) -> dict[str, Path]:
    where.mkdir(parents=True, exist_ok=True)
    log(f"apt-get download {len(packages)} packages")
    # As root, apt fetches as its own user, who cannot write a private folder.
    _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *packages], cwd=where)
    debs = {}
    for deb in sorted(where.glob("*.deb")):
        debs[deb.name.split("_")[0]] = deb
    missing = sorted(set(packages) - set(debs))
    if missing:
        raise BundleError(f"apt-get download left out {missing}")
    return debs


def _find_library(root: Path, soname: str) -> Path | None:
    for folder in ARCH_LIBS:
        path = root / folder / soname
        if path.exists():
            return path
    return None


def _library_closure(root: Path, into: Path) -> list[str]:
    """libbcc.so.0 and every library it needs, transitively, but glibc's and
    the stubbed ones, copied into `into` under their sonames; returns the
    sonames."""
    from mmtrace.agent.discovery.elf_reader import read_elf_file
    into.mkdir(parents=True)
    wanted, done = ["libbcc.so.0"], []
    while wanted:
        soname = wanted.pop()
        if soname in done or soname in GLIBC or soname in STUBBED:
            continue
        path = _find_library(root, soname)
        if path is None:
            raise BundleError(f"{soname} is needed by bcc and is in none of the packages "
                              f"downloaded ({', '.join(BCC_PACKAGES)}): add its package")
        shutil.copy(path.resolve(), into / soname)
        done.append(soname)
        wanted += read_elf_file(into / soname).needed
    return sorted(done)


_DYNSYM = re.compile(r"^\s*\d+:\s+[0-9a-f]+\s+(\d+)\s+(FUNC|OBJECT)\s+\w+\s+\w+\s+(\S+)\s+"
                     r"([^@\s]+)(?:@+(\S+))?")


def _dynamic_symbols(path: Path, undefined: bool) -> dict[str, tuple]:
    """name -> (type, size, version) of the dynamic symbols of `path` that
    are undefined there (`undefined`) or defined there."""
    symbols = {}
    for line in _run(["readelf", "--dyn-syms", "-W", path]).splitlines():
        m = _DYNSYM.match(line)
        if m and (m.group(3) == "UND") == undefined:
            name, version = m.group(4), m.group(5)
            version = version.split(" ")[0].lstrip("@") if version else None
            symbols[name] = (m.group(2), int(m.group(1)), version)
    return symbols


def _stub(root: Path, soname: str, consumers: list[Path], into: Path) -> dict:
    """A library named `soname` that defines what `consumers` take from the
    real one (its package unpacked under `root`), each function aborting
    with a message; returns what it stands for."""
    real = _find_library(root, soname)
    if real is None:
        raise BundleError(f"{soname} is not in {STUBBED[soname]}, downloaded to stub it")
    defined = _dynamic_symbols(real, undefined=False)
    taken = {}
    for consumer in consumers:
        for name, (kind, _, version) in _dynamic_symbols(consumer, undefined=True).items():
            if name in defined:
                taken[name] = (kind, defined[name][1], version or defined[name][2])
    into.mkdir(parents=True, exist_ok=True)
    source = into / f"{soname}.c"
    lines = ["#include <stdio.h>", "#include <stdlib.h>",
             "static void stub(const char *name) {",
             f'    fprintf(stderr, "{soname} is a stub in mmtrace\'s GPU check bundle: '
             f'%s was called\\n", name);', "    abort();", "}"]
    for name, (kind, size, _) in sorted(taken.items()):
        lines.append(f"char {name}[{max(size, 8)}];" if kind == "OBJECT"
                     else f'void {name}(void) {{ stub("{name}"); }}')
    source.write_text("\n".join(lines) + "\n")
    flags = []
    versions = sorted({v for _, _, v in taken.values() if v})
    if versions:
        script = into / f"{soname}.map"
        nodes, before = [], None
        for version in versions:
            names = "".join(f" {n};" for n, (_, _, v) in sorted(taken.items()) if v == version)
            nodes.append(f"{version} {{ global:{names} }}{' ' + before if before else ''};")
            before = version
        script.write_text("\n".join(nodes) + "\n")
        flags = [f"-Wl,--version-script={script}"]
    _run(["gcc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", *flags, "-o",
          into / soname, source])
    source.unlink()
    for script in into.glob("*.map"):
        script.unlink()
    return {"package": STUBBED[soname], "symbols": len(taken), "versions": versions}


def _merge_headers(root: Path, packages: list[str], into: Path) -> str:
    """One tree of kernel headers: -common's include/ and arch/x86/, with
    -amd64's generated files and .config over them; returns its name."""
    flavour, common = (root / "usr/src" / p for p in packages)
    tree = into / flavour.name
    shutil.copytree(common / "include", tree / "include", symlinks=True)
    shutil.copytree(common / "arch/x86", tree / "arch/x86", symlinks=True)
    for part in ("include", "arch/x86"):
        shutil.copytree(flavour / part, tree / part, symlinks=True, dirs_exist_ok=True)
    shutil.copy(flavour / ".config", tree / ".config")
    return tree.name


def _tar_xz(base: Path, names, out: Path):
    with tarfile.open(out.with_suffix(""), "w") as tar:
        for name in names:
            tar.add(base / name, arcname=name)
    # Blocks of 64 MiB: xz compresses them side by side (one block of the
    # whole took 4 minutes of a loaded 2-core host), at ~1 % of the ratio.
    _run(["xz", "-9", "-T0", "--block-size=64MiB", "-f", out.with_suffix("")])


def _wheels(where: Path, log) -> dict:
    """requirements.txt's pure-Python packages as wheels; returns what was
    left out and why. One pip run; a requirement with no pure-Python wheel
    (pip names it) is left out and the rest fetched again."""
    where.mkdir()
    left_out = {}
    requirements = [line.split("#")[0].strip() for line in
                    (ROOT / "requirements.txt").read_text().splitlines()]
    requirements = [r for r in requirements if r]
    log(f"pip download of {len(requirements)} requirements (pure-Python wheels)")
    while requirements:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PURE_WHEEL,
                                 "-d", str(where), *requirements], capture_output=True,
                                text=True)
        if result.returncode == 0:
            break
        found = re.search(r"No matching distribution found for (\S+)", result.stderr)
        if found is None or found.group(1) not in requirements:
            raise BundleError(f"pip download failed: {result.stderr.strip()[-600:]}")
        requirements.remove(found.group(1))
        left_out[found.group(1)] = "no pure-Python wheel (compiled code): the host's own"
    return left_out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_bytes(folder: Path) -> int:
    """The apparent size of every file under `folder`, summed (what a copy of
    it moves)."""
    return sum((Path(d) / f).stat().st_size for d, _, files in os.walk(folder) for f in files)


def _manifest(out: Path, debs, libs, stubs, headers, left_out) -> dict:
    files = {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(out.rglob("*")) if p.is_file()}
    archives = {}
    for name in ("bcc.tar.xz", "headers.tar.xz"):
        with tarfile.open(out / name) as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            archives[name] = {"files": len(members),
                              "unpacked_bytes": sum(m.size for m in members),
                              "top": sorted({m.name.split("/")[0] for m in members})}
    manifest = {
        "limit_bytes": LIMIT_BYTES,
        "packages": {name: deb.name.split("_")[1] for name, deb in sorted(debs.items())},
        "libraries": libs,
        "stubs": stubs,
        "headers": headers,
        "wheels": sorted(n for n in files if n.startswith("wheels/")),
        "not_bundled": left_out,
        "archives": archives,
        "files": files,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    # The text states the folder's size, its own included: the figure has a
    # fixed width, so the text's length does not depend on it.
    manifest["bytes"] = folder_bytes(out) + len(_manifest_text(manifest, 0).encode())
    (out / "MANIFEST.txt").write_text(_manifest_text(manifest, manifest["bytes"]))
    assert folder_bytes(out) == manifest["bytes"], "MANIFEST.txt states the folder's size"
    return manifest


def _manifest_text(m: dict, total: int) -> str:
    lines = [f"mmtrace GPU check bundle: {total:>12} bytes ({total / 2**20:>6.2f} MiB) of "
             f"{m['limit_bytes'] / 2**20:.0f} MiB: the apparent sizes of all its files summed "
             "(this one included), what a copy of the folder moves",
             "", "files:"]
    lines += [f"  {f['bytes']:>12,}  {name}" for name, f in m["files"].items()]
    for name, a in m["archives"].items():
        lines.append(f"{name}: {a['files']} files, {a['unpacked_bytes']:,} bytes unpacked: "
                     + ", ".join(a["top"]))
    lines.append("Debian packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()))
    lines.append("libraries (lib/): " + ", ".join(m["libraries"]))
    for soname, s in m["stubs"].items():
        lines.append(f"stub stubs/{soname}: {s['symbols']} symbols of {s['package']}"
                     + (f" (versions {', '.join(s['versions'])})" if s["versions"] else "")
                     + "; each aborts if called (bcc never calls them)")
    lines.append(f"kernel headers: {m['headers']}")
    lines += [f"not bundled: {r}: {why}" for r, why in m["not_bundled"].items()]
    return "\n".join(lines) + "\n"


# ----- using it (on the host) ------------------------------------------------------

def _host_sonames() -> set[str]:
    """The sonames the host's dynamic loader finds on its own (x86-64)."""
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
            break
        except FileNotFoundError:
            continue
    else:
        return set()
    return {m.group(1) for m in re.finditer(r"^\s*(\S+) \((?:libc6,)?x86-64", text, re.M)}


def _extract(archive: Path, into: Path, stamp: str):
    """Unpack `archive` into `into` once per archive content (`stamp`)."""
    mark = into / ".unpacked"
    if mark.exists() and mark.read_text() == stamp:
        return
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        # Our own archive, its sha256 checked; "tar" keeps its links as they are
        # (Python before 3.11.4 has no filters).
        tar.extractall(into, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    mark.write_text(stamp)


def _importable(names) -> bool:
    import importlib.util
    try:
        return all(importlib.util.find_spec(n) is not None for n in names)
    except (ImportError, ValueError):
        return False


def _wheel_top_level(wheel: zipfile.ZipFile) -> list[str]:
    names = {n.split("/")[0] for n in wheel.namelist()}
    return sorted(n.removesuffix(".py") for n in names
                  if not n.endswith((".dist-info", ".data")) and not n.endswith(".pth"))


def prepare(bundle: Path, work: Path, headers_wanted: bool, bare: bool = False
            ) -> tuple[dict, dict]:
    """Unpack what the host lacks into `work`; return the environment to
    run with (LD_LIBRARY_PATH, PYTHONPATH and, with the bundle's headers,
    BCC_KERNEL_SOURCE) and what was used, for the summary.
    `headers_wanted`: the kernel has no headers of its own. `bare`: use
    all of the bundle, as on a host that has none of it (every library,
    the stubs too, every wheel, the headers through BCC_KERNEL_SOURCE):
    to rehearse such a host on one that has it all."""
    bundle, work = Path(bundle).resolve(), Path(work).resolve()
    manifest_path = bundle / "MANIFEST.json"
    if not manifest_path.exists():
        raise BundleError(f"{bundle} is no bundle: expected {manifest_path} "
                          "(made by bench/gpu_check --bundle DIR)")
    manifest = json.loads(manifest_path.read_text())
    for name in ("bcc.tar.xz", "headers.tar.xz"):
        want = manifest["files"][name]["sha256"]
        if not (bundle / name).exists() or _sha256(bundle / name) != want:
            raise BundleError(f"{bundle / name}: expected sha256 {want[:12]}…, as MANIFEST.json "
                              "says; the file is missing or changed")
    _extract(bundle / "bcc.tar.xz", work / "bcc", manifest["files"]["bcc.tar.xz"]["sha256"])
    host = set() if bare else _host_sonames()
    ld = work / "ld"
    shutil.rmtree(ld, ignore_errors=True)
    ld.mkdir(parents=True)
    used = {"bundled_libraries": [], "host_libraries": [], "stubs": [], "wheels": []}
    for folder in ("lib", "stubs"):
        for lib in sorted((work / "bcc" / folder).iterdir()):
            if lib.name in ALWAYS_BUNDLED or lib.name not in host:
                (ld / lib.name).symlink_to(lib)
                used["stubs" if folder == "stubs" else "bundled_libraries"].append(lib.name)
            else:
                used["host_libraries"].append(lib.name)
    site = work / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir()
    for wheel_path in sorted((bundle / "wheels").glob("*.whl")):
        with zipfile.ZipFile(wheel_path) as wheel:
            if not bare and _importable(_wheel_top_level(wheel)):
                continue
            wheel.extractall(site)
            used["wheels"].append(wheel_path.name)
    if bare or not _importable(["mmtrace.agent"]):
        _link_checkout(site / "mmtrace")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = _path_list(ld, env.get("LD_LIBRARY_PATH"))
    env["PYTHONPATH"] = _path_list(site, _path_list(work / "bcc" / "python",
                                                     env.get("PYTHONPATH")))
    used["headers"] = None
    if headers_wanted or bare:
        _extract(bundle / "headers.tar.xz", work / "headers",
                 manifest["files"]["headers.tar.xz"]["sha256"])
        tree = work / "headers" / manifest["headers"]
        used["headers"] = str(tree)
        if bare or not _link_headers(tree):
            env["BCC_KERNEL_SOURCE"] = str(tree)
            used["headers"] += " (BCC_KERNEL_SOURCE)"
        else:
            used["headers"] += f" (linked as /lib/modules/{os.uname().release}/build)"
    return env, used


def _path_list(first: Path, rest: str | None) -> str:
    return ":".join(filter(None, [str(first), rest]))


def _link_checkout(into: Path):
    """The checkout's folders as the `mmtrace` namespace, as pyproject.toml
    maps them: what `pip install -e .` gives, without pip."""
    import tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    into.mkdir(parents=True)
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        (into / package.split(".", 1)[1]).symlink_to(ROOT / folder)


def _link_headers(tree: Path) -> bool:
    """Link the headers as scripts/setup does where the kernel has none;
    False where /lib/modules cannot be written."""
    mod = Path("/lib/modules") / os.uname().release
    try:
        mod.mkdir(parents=True, exist_ok=True)
        for name in ("build", "source"):
            link = mod / name
            if link.is_symlink():
                link.unlink()
            link.symlink_to(tree)
        return True
    except OSError:
        return False


def scrubbed_env(env: dict, work: Path) -> dict:
    """`env` without the paths prepare() put in front: what a workload that
    needs none of it (PyTorch) runs with."""
    work = str(Path(work).resolve())
    out = dict(env)
    for key in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        if key in out:
            kept = [p for p in out[key].split(":") if p and not p.startswith(work)]
            if kept:
                out[key] = ":".join(kept)
            else:
                del out[key]
    out.pop("BCC_KERNEL_SOURCE", None)
    return out
