"""A stand-in `npu-smi` for hosts without Ascend drivers: a shell script
printing the documented layouts of `npu-smi info -l`, `info -t usages -i N`
and `info -t common -i N` from files beside it, which tests rewrite."""

import stat
from pathlib import Path

STANDIN = """#!/bin/sh
# npu-smi info -l | npu-smi info -t usages|common -i N
here=$(dirname "$0")
case "$2" in
    -l) cat "$here/list" ;;
    -t) cat "$here/$3-$5" 2>/dev/null || { echo "no NPU $5" >&2; exit 1; } ;;
    *) exit 2 ;;
esac
"""
LIST = """        Total Count                    : 2

        NPU ID                         : 0
        Chip Count                     : 1

        NPU ID                         : 1
        Chip Count                     : 2
"""


def usages(hbm_mb, hbm_pct, aicore_pct, bw_pct, chip=None):
    text = (f"        HBM Capacity(MB)               : {hbm_mb}\n"
            f"        HBM Usage Rate(%)              : {hbm_pct}\n"
            f"        Aicore Usage Rate(%)           : {aicore_pct}\n"
            f"        HBM Bandwidth Usage Rate(%)    : {bw_pct}\n")
    return text + (f"        Chip ID                        : {chip}\n" if chip is not None else "")


def common(temp_c, power_w):
    return (f"        NPU ID                         : 0\n"
            f"        Aicore Freq(MHZ)               : 1650\n"
            f"        Temperature(C)                 : {temp_c}\n"
            f"        NPU Real-time Power(W)         : {power_w}\n")


def write_npus(folder, aicore, temp):
    (folder / "usages-0").write_text("        NPU ID                         : 0\n"
                                     + usages(65536, 50, aicore[0], 20))
    (folder / "common-0").write_text(common(temp, 300.5))
    (folder / "usages-1").write_text(usages(32768, 25, aicore[1], 0, chip=0)
                                     + usages(32768, 75, aicore[2], 40, chip=1))
    (folder / "common-1").write_text(common(40, 90))


def install_standin(folder: Path, aicore=(50, 10, 0), temp=70) -> Path:
    """The script as `folder/npu-smi`, with two cards (the second with two
    chips); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "npu-smi"
    script.write_text(STANDIN)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (folder / "list").write_text(LIST)
    write_npus(folder, aicore=aicore, temp=temp)
    return script
