"""RecordBaseline's calibration message: made once per fit, and never one of an earlier fit."""

from __future__ import annotations

from typing import Any

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc.api.servicer import ContextServicer
from contextsvc.config import Settings
from contextsvc.core.calibration import Calibration
from contextsvc.core.priors import N_FEATURES
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine


class _Context:
    async def abort_with_status(self, status: Any) -> None:
        raise AssertionError(f"call failed: {status}")


def _servicer() -> ContextServicer:
    settings = Settings()
    return ContextServicer(make_engine(MemoryStore(settings), settings))


def _cal(observations: int, weight: float) -> Calibration:
    return Calibration(weights=(weight,) * N_FEATURES, observations=observations, fitted=True, margin=0.1)


def _decoded(field: bytes) -> r.Calibration:
    """The calibration message of a ``calibration`` field's bytes (a response holding only it)."""
    return pb.RecordBaselineResponse.FromString(field).calibration


def test_one_encoding_per_calibration_object_and_model() -> None:
    servicer = _servicer()
    first = _cal(3, 0.25)
    made = servicer._calibration_field("m", first)
    assert _decoded(made).model == "m" and _decoded(made).observations == 3 and _decoded(made).fitted
    assert servicer._calibration_field("m", first) is made
    # An equal calibration that is another object (a new fit) is encoded again, as is another model.
    again = servicer._calibration_field("m", _cal(3, 0.25))
    assert again is not made and again == made
    other_model = servicer._calibration_field("n", _cal(3, 0.25))
    assert _decoded(other_model).model == "n"
    later = _cal(4, 0.5)
    refit = _decoded(servicer._calibration_field("n", later))
    assert refit.observations == 4 and refit.per_message == 0.5 and refit.model == "n"


async def test_each_baseline_answers_the_fit_holding_its_observation() -> None:
    servicer = _servicer()
    ctx: Any = _Context()
    sid = (await servicer.CreateSession(pb.CreateSessionRequest(name="s"), ctx)).id
    counts = []
    for turn in range(4):
        await servicer.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=sid,
                messages=[
                    r.Message(role=r.ROLE_USER, content=f"question {turn} " * (5 + turn)),
                    r.Message(role=r.ROLE_ASSISTANT, content=f"answer {turn} " * (9 + 3 * turn)),
                ],
            ),
            ctx,
        )
        built = pb.BuildContextResponse.FromString(
            (await servicer.BuildContext(pb.BuildContextRequest(session_id=sid), ctx)).data
        )
        answer = pb.RecordBaselineResponse.FromString(
            (
                await servicer.RecordBaseline(
                    pb.RecordBaselineRequest(
                        session_id=sid, view_id=built.view_id, prompt_tokens=int(built.estimate.total * 1.1) + 3
                    ),
                    ctx,
                )
            ).data
        )
        assert answer.recorded
        counts.append(answer.calibration.observations)
        model = servicer._engine.accounting._registry.calibration(answer.calibration.model)
        assert answer.calibration.observations == model.observations
        assert answer.calibration.overhead == model.overhead
    assert counts == [1, 2, 3, 4]
