"""Import first: puts this checkout ahead of any installed copy of contextsvc on ``sys.path``.

Run as ``python bench/load/run.py``, Python puts only ``bench/store`` on the path, and
``contextsvc`` would come from wherever the package is installed (an editable install may point
at another clone); the benchmark must measure the code it sits next to.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
