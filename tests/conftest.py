import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Kernel objects are content-addressed: sharing them across the tests (and
# across local runs) is safe and keeps the suite fast.
os.environ.setdefault("CUVIL_CACHE_DIR", str(ROOT / ".cuvil-cache" / "tests"))


import pytest  # noqa: E402


@pytest.fixture
def direct_convs():
    """Compile options for tests of the direct conv paths (convgemm.py, convsmall.py) on shapes
    Winograd would take: without the pass that marks convs for it."""
    return {"disable_passes": ("winograd",)}
