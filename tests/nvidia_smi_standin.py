"""A stand-in `nvidia-smi` for hosts without an NVIDIA driver: a script that
answers `--query-gpu=FIELD,... --format=csv,noheader,nounits` from the
state file the stand-in libnvidia-ml.so.1 reads ($MMTRACE_NVML_STATE,
tests/nvml_standin.py's format), in nvidia-smi's units: so NVML and it
report the same devices, as on a real host."""

import stat
import sys
from pathlib import Path

STANDIN = '''#!{python}
# nvidia-smi --query-gpu=FIELD,... --format=csv,noheader,nounits (stand-in)
import os, sys
query = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-gpu=")]
if not query or "--format=csv,noheader,nounits" not in sys.argv[1:]:
    sys.exit("nvidia-smi stand-in: expected --query-gpu=FIELDS --format=csv,noheader,nounits")
state = os.environ.get("MMTRACE_NVML_STATE")
if not state or not os.path.exists(state):
    sys.exit("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
for index, line in enumerate(open(state).read().split("\\n")):
    if not line.strip():
        continue
    (bus, name, sm, membw, total, used, temp, power_mw) = line.split()[:8]
    values = {{"index": index, "name": name, "pci.bus_id": "0000" + bus.upper(),
              "memory.total": int(total) >> 20, "memory.used": int(used) >> 20,
              "utilization.gpu": sm, "utilization.memory": membw, "temperature.gpu": temp,
              "power.draw": "%.2f" % (int(power_mw) / 1000)}}
    fields = query[0].split(",")
    unknown = [f for f in fields if f not in values]
    if unknown:
        sys.exit('Field "%s" is not a valid field to query.' % unknown[0])
    print(", ".join(str(values[f]) for f in fields))
'''


def install_standin(folder: Path) -> Path:
    """The script as `folder/nvidia-smi`; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(STANDIN.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script
