"""A fork's ``context_tokens`` (Session, AppendMessagesResponse and its ``window_fraction``) stays
the price of its context for the model its runtime uses.

The fork's rows carry the prices the parent's appends gave them, for the parent's remembered
model. The fork remembered no profile, so its first build with that same profile took it for a
model change and repriced the rows from the default model: the difference of the two models'
prices stayed in the count as if the client sent it beside the view: a third more than the context
held for a model that counts more tokens than the default's prior, on every later append too."""

from __future__ import annotations

from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.state import EngineState
from tests.support.compaction_harness import Rig, a, real_tokens, u, words

PROFILE = ProfileOverrides(model="fork-model", context_window=32768)


async def test_a_fork_built_with_its_parents_profile_counts_its_context_at_that_models_price() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        for k in range(16):
            await rig.append(sid, u(f"ask {k} " + words(50)), a(f"answer {k} " + words(80)))
            view = await rig.build(sid, profile=PROFILE)
            # A model that counts many more tokens than the default's prior: its calibration learns it.
            await rig.baseline(sid, view, slope=0.8, overhead=4)
        parent = await rig.session_info(sid)

        fork = await rig.engine.sessions.fork(ANONYMOUS, sid, at_sequence=0)
        view = await rig.build(fork.id, profile=PROFILE)
        info = await rig.session_info(fork.id)
        # The same context as the parent's, for the same model: about the same count as the
        # parent's and the fork's own view (not a model change's repricing on top).
        assert info.context_tokens <= 1.1 * view.estimate.total, (info.context_tokens, view.estimate.total)
        assert info.context_tokens <= 1.1 * parent.context_tokens, (info.context_tokens, parent.context_tokens)

        ask = [u("one more ask " + words(50))]
        appended = await rig.engine.append(ANONYMOUS, fork.id, ask, request_id="", turn_complete=False)
        view = await rig.build(fork.id, profile=PROFILE)
        assert appended.context_tokens <= 1.1 * view.estimate.total, (appended.context_tokens, view.estimate.total)
    finally:
        await rig.close()


async def test_a_fork_prices_the_tools_its_parent_learned_it_sends_beside_each_view() -> None:
    """The tokens a session's client sends beside each view (tool definitions, learned from its
    baselines) are part of the state a fork copies: its first view, priced whole, holds them, as
    the parent's next whole-priced view would. Without them the fork's first estimate came out
    3,000 tokens under its real count, and an append that the parent would have compacted for
    was served to the provider over the budget."""
    window = 8192
    rig = await Rig.start(window=window, reserve=window // 4)
    try:
        sid = await rig.session()
        for k in range(3):
            await rig.append(sid, u(f"ask {k} about module_{k}.py " + words(40)), a(f"answer {k} " + words(80)))
            view = await rig.build(sid)
            await rig.engine.record_baseline(
                ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=real_tokens(view) + 3000
            )
            await rig.engine.anchors_applied(5)
        assert EngineState.of(await rig.session_info(sid)).beside > 2500

        fork = await rig.engine.sessions.fork(ANONYMOUS, sid, at_sequence=0)
        view = await rig.build(fork.id)
        real = real_tokens(view) + 3000
        assert abs(view.estimate.total - real) <= 0.05 * real, (view.estimate.total, real)
    finally:
        await rig.close()
