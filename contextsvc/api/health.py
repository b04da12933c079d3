"""grpc.health.v1.Health with every method of the contract implemented.

The asyncio servicer shipped with grpcio-health-checking has no ``List``: it answers UNIMPLEMENTED
but logs a full traceback each time, which any client could use to flood the log.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio


class HealthService(health_aio.HealthServicer):  # type: ignore[misc]
    async def List(self, request: Any, context: Any) -> Any:
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()}
        return health_pb2.HealthListResponse(statuses=statuses)
