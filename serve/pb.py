"""Message classes and method descriptors of `serve/proto/k3jax/v1/generation.proto`.

No `*_pb2.py` gencode: the .proto's FileDescriptorProto is checked in as bytes
(`serve/_descriptor.py`, written by `python -m serve.protogen` with grpcio-tools' protoc), added to
protobuf's default pool (so server reflection serves it), and the message classes come from
`message_factory`. This has no gencode/runtime version coupling (it imports with any protobuf
runtime >= 4.21, e.g. the GPU machine's, which has no grpcio-tools), and tests/test_serve.py
checks that regenerating `_descriptor.py` from the .proto gives the identical file.
The service is wired by hand (`generic_handler` on the server, `GenerationStub` on the client),
which is all a `*_pb2_grpc.py` file would contain.

    from serve import pb
    req = pb.GenerateRequest(text="Hello", max_new_tokens=8)

After editing the .proto: `python -m serve.protogen` (needs grpcio-tools, a dev dependency).
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

PROTO_FILE = "k3jax/v1/generation.proto"  # the descriptor's name (import path) in the pool
PACKAGE = "k3jax.v1"
SERVICE_NAME = "k3jax.v1.Generation"


def _load():
    pool = descriptor_pool.Default()
    try:  # already loaded (e.g. this module reloaded)
        return pool.FindFileByName(PROTO_FILE)
    except KeyError:
        pass
    from serve._descriptor import SERIALIZED_FILE_DESCRIPTOR

    pool.AddSerializedFile(SERIALIZED_FILE_DESCRIPTOR)
    return pool.FindFileByName(PROTO_FILE)


DESCRIPTOR = _load()
_message_class = getattr(message_factory, "GetMessageClass", None) or message_factory.MessageFactory().GetPrototype

# every message of the .proto as a module attribute: pb.GenerateRequest, pb.ModelInfo, ...
for _name, _desc in DESCRIPTOR.message_types_by_name.items():
    globals()[_name] = _message_class(_desc)
del _name, _desc

FinishReason = enum_type_wrapper.EnumTypeWrapper(DESCRIPTOR.enum_types_by_name["FinishReason"])
FINISH_REASON_UNSPECIFIED = FinishReason.Value("FINISH_REASON_UNSPECIFIED")
FINISH_REASON_LENGTH = FinishReason.Value("FINISH_REASON_LENGTH")
FINISH_REASON_EOS = FinishReason.Value("FINISH_REASON_EOS")
FINISH_REASON_STOP = FinishReason.Value("FINISH_REASON_STOP")
FINISH_REASON_ABORT = FinishReason.Value("FINISH_REASON_ABORT")

SERVICE = DESCRIPTOR.services_by_name["Generation"]

# method name -> (request class, response class, server streaming)
METHODS = {
    "Generate": (GenerateRequest, GenerateResponse, True),  # noqa: F821 (defined above via globals())
    "Abort": (AbortRequest, AbortResponse, False),  # noqa: F821
    "GetModelInfo": (GetModelInfoRequest, ModelInfo, False),  # noqa: F821
}
assert set(METHODS) == {m.name for m in SERVICE.methods}, "METHODS out of sync with the .proto"


def method_path(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


def generic_handler(servicer) -> grpc.GenericRpcHandler:
    """The service's handler for `server.add_generic_rpc_handlers`: `servicer` has one (async)
    method per RPC, named as in the .proto."""
    handlers = {}
    for name, (req, resp, streaming) in METHODS.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(servicer, name), request_deserializer=req.FromString,
                              response_serializer=resp.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class GenerationStub:
    """Client stub for a grpc (sync) or grpc.aio channel: `stub.Generate(req, metadata=...)` etc."""

    def __init__(self, channel):
        for name, (req, resp, streaming) in METHODS.items():
            make = channel.unary_stream if streaming else channel.unary_unary
            setattr(self, name, make(method_path(name), request_serializer=req.SerializeToString,
                                     response_deserializer=resp.FromString))

