# ruff: noqa: E501  (table rows are one line each)
"""Probe: the engine's token estimates on message kinds the benches cover thinly (kinds_corpus.py).

    python bench/fidelity/probe_kinds.py                 # dev and held-out tables
    python bench/fidelity/probe_kinds.py --split held    # one split
    python bench/fidelity/probe_kinds.py --sessions 2    # fewer sessions per kind

Needs bench/tokens/node_modules (``python bench/tokens/run.py`` installs it). In process: the
real ``Engine`` over the memory store, a fresh engine (cold calibration) per session and model.
Each session is replayed as a runtime would: append a step, ``BuildContext`` (no compression:
a 1,000,000-token window), the real count of the view (bench/tokens' ChatML-like rendering,
3 frame tokens per message and 3 for the reply primer), ``RecordBaseline`` with it. Errors are
(estimate - real) / real in %; tables print the median |error| and the signed worst.

- views: the view's estimate at step 0 (cold), after 1, 2 and 6 baselines;
- lists: ``EstimateTokens`` of each step's messages alone (no primer) on a cold engine, and on
  the engine after the session's 3 first baselines (the steps after them only);
- cross: after 3 baselines on one kind, the standalone lists of every *other* kind, against the
  same lists cold: the worst kinds a baseline on other content moved away from the truth;
- images: ``EstimateTokens`` image tokens of unusual sizes against DESIGN §5.3's formula
  written out here, and a text estimate after a baseline on a view with images.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "bench" / "tokens"))
sys.path.insert(0, str(ROOT))

from kinds_corpus import KINDS, Session, sessions  # noqa: E402
from run import FRAME_PER_MESSAGE, FRAME_PER_PROMPT, count_real, ensure_node_deps, render  # noqa: E402

from contextsvc.clock import SystemClock  # noqa: E402
from contextsvc.config import ProfileConfig, Settings  # noqa: E402
from contextsvc.core.messages import Message, Role  # noqa: E402
from contextsvc.core.profile import ProfileOverrides  # noqa: E402
from contextsvc.core.session import ANONYMOUS  # noqa: E402
from contextsvc.engine.engine import Engine  # noqa: E402
from contextsvc.engine.validation import IncomingImage, IncomingMessage  # noqa: E402
from contextsvc.events.memory_bus import MemoryEventBus  # noqa: E402
from contextsvc.stores.memory import MemoryStore  # noqa: E402
from contextsvc.summarizers.extractive import ExtractiveSummarizer  # noqa: E402
from contextsvc.summarizers.registry import SummarizerSet  # noqa: E402

MODELS = {"o200k": "gpt-4o", "cl100k": "gpt-4", "llama3": "llama-3-8b", "claude": "claude-2"}
WINDOW = 1_000_000


class Counts:
    """Real tokens per rendered message, per tokenizer (counted once per distinct text)."""

    def __init__(self, texts: Sequence[str]) -> None:
        uniq = sorted(set(texts))
        raw = count_real(uniq)
        self.by = {t: dict(zip(uniq, raw[t], strict=True)) for t in MODELS}

    def message(self, t: str, m: Message) -> int:
        return self.by[t][render(m)] + FRAME_PER_MESSAGE

    def view(self, t: str, msgs: Sequence[Message]) -> int:
        return sum(self.message(t, m) for m in msgs) + FRAME_PER_PROMPT

    def lst(self, t: str, msgs: Sequence[Message]) -> int:
        return sum(self.message(t, m) for m in msgs)


def engine_for(system: str) -> tuple[Engine, MemoryStore]:
    profile = ProfileConfig(
        model="m", context_window=WINDOW, output_reserve_tokens=2048, system_prompt=system, vision=True
    )
    settings = Settings(profiles={"default": profile}, store="memory", event_retention=1000)
    store = MemoryStore(settings)
    eng = Engine(
        store=store,
        bus=MemoryEventBus(retention=1000),
        settings=settings,
        clock=SystemClock(),
        summarizers=SummarizerSet({"extractive": ExtractiveSummarizer.from_settings(settings)}),
    )
    return eng, store


def err(est: float, real: float) -> float:
    return 100.0 * (est - real) / real


class Probe:
    def __init__(self, counts: Counts) -> None:
        self.c = counts

    async def replay(self, s: Session, t: str, baselines: int) -> tuple[dict[int, float], Engine, MemoryStore]:
        """Views of the session with a baseline after each of the first ``baselines`` builds;
        returns {step: error %} and the engine (calibrated by those baselines)."""
        eng, store = engine_for(s.system)
        await store.open()
        prof = ProfileOverrides(model=MODELS[t])
        sess = await eng.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
        out: dict[int, float] = {}
        for k, step in enumerate(s.steps):
            await eng.append(ANONYMOUS, sess.id, [IncomingMessage(m) for m in step], request_id="", turn_complete=False)
            view = await eng.build_context(
                ANONYMOUS, sess.id, profile=prof, incoming=None, mid_turn=False, auto_compress=False
            )
            real = self.c.view(t, [vm.message for vm in view.messages])
            out[k] = err(view.estimate.total, real)
            if k < baselines:
                res = await eng.record_baseline(ANONYMOUS, sess.id, view_id=view.view_id, prompt_tokens=real)
                if not res.recorded:
                    print(f"  ! {s.kind}/{t} step {k}: honest baseline not recorded (truncated={res.truncated})")
                await eng.anchors_applied(5.0)
        return out, eng, store

    async def list_err(self, eng: Engine, t: str, msgs: Sequence[Message]) -> float:
        est = await eng.estimate_tokens(
            ANONYMOUS,
            model=MODELS[t],
            messages=[IncomingMessage(m) for m in msgs],
            session_id="",
            profile=ProfileOverrides(),
        )
        return err(est.total, self.c.lst(t, msgs))


def med(xs: Sequence[float]) -> float:
    return statistics.median(abs(x) for x in xs) if xs else math.nan


def worst(xs: Sequence[float]) -> float:
    return max(xs, key=abs) if xs else math.nan


def c4(msgs: Sequence[Message], real: int) -> float:
    chars = sum(len(m.content) + sum(len(c.arguments_json) for c in m.tool_calls) for m in msgs)
    return err(chars / 4, real)


async def run_split(split: str, n_sessions: int) -> None:
    data = sessions(split, count=n_sessions)
    texts = [render(Message(role=Role.SYSTEM, content=s.system)) for ss in data.values() for s in ss]
    texts += [render(m) for ss in data.values() for s in ss for step in s.steps for m in step]
    counts = Counts(texts)
    p = Probe(counts)
    print(f"\n## split: {split} ({n_sessions} sessions x 8 steps per kind; error % = (est - real) / real)\n")
    print(
        "| kind | model | views cold | 1 bl | 2 bl | 6 bl | worst view after 2 | lists cold | lists after 3 bl | worst list | chars/4 lists | tok/char |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    calibrated: dict[tuple[str, str], Engine] = {}
    cold_lists: dict[tuple[str, str], list[float]] = {}
    for kind in KINDS:
        for t in MODELS:
            v: dict[int, list[float]] = {}
            after2: list[float] = []
            lc: list[float] = []
            l3: list[float] = []
            c4l: list[float] = []
            tpc: list[float] = []
            for s in data[kind]:
                errs, eng, _ = await p.replay(s, t, baselines=6)
                for k, e in errs.items():
                    v.setdefault(min(k, 6) if k in (0, 1, 2, 6) else -1, []).append(e)
                    if k >= 2:
                        after2.append(e)
                cold, cstore = engine_for(s.system)
                await cstore.open()
                for step in s.steps:
                    lc.append(await p.list_err(cold, t, step))
                    real = counts.lst(t, step)
                    c4l.append(c4(step, real))
                    tpc.append(real / max(1, sum(len(render(m)) for m in step)))
                _, eng3, _ = await p.replay(s, t, baselines=3)
                for step in s.steps[3:]:
                    l3.append(await p.list_err(eng3, t, step))
                calibrated.setdefault((kind, t), eng3)
            cold_lists[(kind, t)] = lc
            print(
                f"| {kind} | {t} | {med(v[0]):.1f} | {med(v[1]):.1f} | {med(v[2]):.1f} | {med(v[6]):.1f} | {worst(after2):+.1f} "
                f"| {med(lc):.1f} | {med(l3):.1f} | {worst(lc + l3):+.1f} | {med(c4l):.1f} | {statistics.median(tpc):.3f} |"
            )
    # cross: an engine calibrated on kind A pricing kind B's lists, against B cold.
    print("\n### cross-kind: lists of kind B after 3 baselines on kind A (median |err| %), the worst pairs\n")
    rows = []
    for (a, t), eng in calibrated.items():
        for b in KINDS:
            if b == a:
                continue
            errs = [await p.list_err(eng, t, step) for s in data[b][:1] for step in s.steps]
            cold = cold_lists[(b, t)][: len(errs)]
            rows.append((med(errs) - med(cold), a, b, t, med(cold), med(errs), worst(errs)))
    rows.sort(reverse=True)
    print("| baselines on | priced | model | cold | after | worst after |")
    print("|---|---|---|---|---|---|")
    for _, a, b, t, cold_m, after_m, w in rows[:15]:
        print(f"| {a} | {b} | {t} | {cold_m:.1f} | {after_m:.1f} | {w:+.1f} |")


# --- images ------------------------------------------------------------------------------------


def spec_image_tokens(w: int, h: int) -> int:
    """DESIGN §5.3 written out: fit in 2048x2048 keeping aspect, 32-px patches, clamp [256, 4096], +2."""
    scale = min(1.0, 2048 / max(w, h))
    sw, sh = max(1, math.floor(w * scale)), max(1, math.floor(h * scale))
    return min(max(math.ceil(sw / 32) * math.ceil(sh / 32), 256), 4096) + 2


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header says w x h (a 1x1 image's IHDR patched: no pixels are decoded)."""
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = 8 + 8  # signature, then length + "IHDR"
    data[ihdr : ihdr + 8] = struct.pack(">II", w, h)
    crc = zlib.crc32(bytes(data[12 : ihdr + 13])) & 0xFFFFFFFF
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


async def images() -> None:
    from PIL import Image

    print("\n## images: EstimateTokens image tokens against the DESIGN formula\n")
    sizes = [
        (1, 1),
        (8, 8),
        (31, 33),
        (100, 100),
        (1024, 1024),
        (2048, 2048),
        (2049, 2049),
        (4000, 3000),
        (1, 5000),
        (5000, 1),
        (20000, 20),
        (65535, 65535),
        (3000, 2000),
        (2047, 1),
        (640, 4096),
    ]
    eng, store = engine_for("")
    await store.open()
    print("| size | format | estimated | formula | diff |")
    print("|---|---|---|---|---|")
    bad = 0
    for w, h in sizes:
        for fmt in ("PNG", "GIF", "WEBP"):
            if fmt == "PNG" and w * h > 4_000_000:
                data = png_header(w, h)
            elif w * h > 4_000_000 or (fmt == "WEBP" and max(w, h) > 16383) or (fmt == "GIF" and max(w, h) > 65535):
                continue
            else:
                buf = io.BytesIO()
                Image.new("RGB", (w, h)).save(buf, format=fmt)
                data = buf.getvalue()
            msg = IncomingMessage(Message(role=Role.USER, content="x"), images=(IncomingImage(data=data),))
            est = await eng.estimate_tokens(
                ANONYMOUS, model="gpt-4o", messages=[msg], session_id="", profile=ProfileOverrides()
            )
            want = spec_image_tokens(w, h)
            if est.images != want:
                bad += 1
            print(f"| {w}x{h} | {fmt} | {est.images} | {want} | {est.images - want:+d} |")
    for label, data in (("garbage bytes", b"\x00\x01not an image" * 10), ("truncated PNG", png_header(100, 100)[:20])):
        msg = IncomingMessage(Message(role=Role.USER, content="x"), images=(IncomingImage(data=data),))
        est = await eng.estimate_tokens(
            ANONYMOUS, model="gpt-4o", messages=[msg], session_id="", profile=ProfileOverrides()
        )
        print(f"| {label} | - | {est.images} | 1024 (fallback) | {est.images - 1024:+d} |")
    print(f"\nimage sizes off the formula: {bad}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("dev", "held", "both"), default="both")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--no-images", action="store_true")
    args = ap.parse_args()
    ensure_node_deps()
    for split in ("dev", "held") if args.split == "both" else (args.split,):
        await run_split(split, args.sessions)
    if not args.no_images:
        await images()


if __name__ == "__main__":
    asyncio.run(main())
