"""Whether the bcc module imports, and from where: `mmtrace doctor` asks
here, since this layer is the only one that imports bcc."""

import os

from mmtrace.agent.findings import Check


def check_bcc() -> Check:
    try:
        import bcc
    except ImportError as exc:
        return Check("bcc", False, True, f"the bcc module does not import ({exc})",
                     "apt-get install python3-bpfcc bpfcc-tools, and use a venv made with "
                     "/usr/bin/python3 -m venv --system-site-packages (scripts/setup)")
    version = getattr(bcc, "__version__", "unknown version")
    return Check("bcc", True, True, f"bcc {version} from {os.path.dirname(bcc.__file__)}")
