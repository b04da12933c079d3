"""What one calibration fit costs (every RecordBaseline refits its model), this checkout vs a git ref.

    python bench/load/fit_cost.py              # against main
    python bench/load/fit_cost.py --ref HEAD~3 --fits 300

Loads ``contextsvc/core/calibration.py`` as it is at ``--ref`` (``git show``) beside this
checkout's, checks that both give the same fit to the last bit on ``--fits`` random observation
sets (1-12 baselines, mixed content classes, honest and off counts), then times a fit of a full
window of baselines (``tokens.calibration_window``, realistic counts) in interleaved rounds and
prints the fastest round of each (CPU time of this process). As in the agent turn loop, each
timed fit's window is the previous one plus one new baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import _checkout  # noqa: F401 - this checkout's contextsvc

from contextsvc.config import Settings
from contextsvc.core import calibration as here

ROOT = Path(__file__).resolve().parents[2]
TOKENS = Settings().tokens


def _load_source(ref: str, path_in_repo: str, name: str) -> ModuleType | None:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:{path_in_repo}"], check=False, capture_output=True, text=True
    )
    if done.returncode != 0:
        return None
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(done.stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_ref(ref: str) -> ModuleType:
    """calibration.py as it is at ``ref``, fitting with that ref's kernels (calibration_solve.py)
    when it has them, so both files' changes are compared."""
    module = _load_source(ref, "contextsvc/core/calibration.py", "calibration_ref")
    assert module is not None, f"no contextsvc/core/calibration.py at {ref}"
    solver = _load_source(ref, "contextsvc/core/calibration_solve.py", "calibration_solve_ref")
    if solver is not None and hasattr(module, "solver"):
        module.solver = solver
    return module


Point = tuple[float, int, tuple[float, ...], float | None]


def observations(rng: random.Random, n: int, spread: bool) -> list[Point]:
    nf = here.N_FEATURES
    out = []
    for _ in range(n):
        f = [0.0] * nf
        for j in rng.sample(range(nf - 3), rng.randint(1, 5)):
            f[j] = rng.uniform(1, 8000)
        f[nf - 3], f[nf - 2], f[nf - 1] = rng.randint(1, 300), rng.randint(0, 30), rng.choice([0, 1])
        ratio = rng.choice([1.0, 1.0, 0.5, 2.0, 1.05, 0.97, rng.uniform(0.3, 3)]) if spread else rng.uniform(0.97, 1.03)
        tokens = max(1, int(sum(f) / rng.choice([2.5, 3.5, 4.0]) * ratio))
        out.append((sum(f), tokens, tuple(f), rng.choice([None, 0.01, -0.02, 0.1])))
    return out


def fit_with(module: ModuleType, points: list[Point], family: str) -> object:
    obs = [module.Observation(chars=int(c), tokens=t, features=f, residual=r) for c, t, f, r in points]
    return module.fit(obs, TOKENS, family=family)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="main")
    parser.add_argument("--fits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ref = load_ref(args.ref)
    rng = random.Random(11)
    differ = 0
    for _ in range(args.fits):
        points = observations(rng, rng.randint(1, 12), spread=True)
        family = rng.choice(["default", "o200k", "cl100k"])
        a, b = fit_with(here, points, family), fit_with(ref, points, family)
        fields = ("weights", "margin", "margins", "residuals", "evidence", "observations")
        differ += any(getattr(a, k) != getattr(b, k) for k in fields)
    window = TOKENS.calibration_window
    # As in the agent turn loop: every fit's window is the last one plus one new baseline.
    history = observations(random.Random(3), window + 40 * args.rounds * 2, spread=False)
    best = {"ref": float("inf"), "here": float("inf")}
    at = window
    for _ in range(args.rounds):
        for name, module in (("ref", ref), ("here", here)):
            start = time.process_time()
            for _ in range(40):
                at += 1
                fit_with(module, history[at - window : at], "o200k")
            best[name] = min(best[name], (time.process_time() - start) / 40 * 1e3)
    print(f"fits compared: {args.fits}, differing: {differ}")
    print(
        f"one fit of {window} baselines (a window sliding by one), ms CPU: "
        f"{args.ref} {best['ref']:.2f}, this checkout {best['here']:.2f}"
    )
    print(f"ratio: {best['ref'] / best['here']:.2f}x")


if __name__ == "__main__":
    main()
