"""Where the shared DeepSpeed example configs live: `shared/` beside the checkout (as CI lays it
out), else this workplace's /work/shared."""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_CANDIDATES = [os.path.normpath(os.path.join(_HERE, "..", "..", "..", "shared")), "/work/shared"]
SHARED = next((p for p in _CANDIDATES if os.path.isdir(os.path.join(p, "ds_configs"))), _CANDIDATES[0])
DS_COMPRESSION = os.path.join(SHARED, "ds_configs", "compression")
