"""The generated protobuf and gRPC modules of the ``contextsvc.v1`` contract, at a stable public path.

The code itself is generated into ``contextsvc._gen.v1`` by ``scripts/gen_protos.py``; this package
re-exports it so callers never import a private-looking path::

    from contextsvc.v1 import context_service_pb2, context_service_pb2_grpc, resources_pb2, events_pb2
"""

import sys as _sys

from contextsvc._gen.v1 import (
    context_service_pb2 as context_service_pb2,
)
from contextsvc._gen.v1 import (
    context_service_pb2_grpc as context_service_pb2_grpc,
)
from contextsvc._gen.v1 import (
    events_pb2 as events_pb2,
)
from contextsvc._gen.v1 import (
    resources_pb2 as resources_pb2,
)

__all__ = ["context_service_pb2", "context_service_pb2_grpc", "events_pb2", "resources_pb2"]

# ... and importable by that path too (`from contextsvc.v1.context_service_pb2 import
# GetSessionRequest`, `import contextsvc.v1.events_pb2`): the same module objects, not copies.
for _name in __all__:
    _sys.modules[f"{__name__}.{_name}"] = globals()[_name]
del _name
