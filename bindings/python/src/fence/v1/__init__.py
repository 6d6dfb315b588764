"""Generated ``fence.v1`` protobuf messages and gRPC stubs.

``fence_pb2``, ``fence_pb2.pyi`` and ``fence_pb2_grpc`` are produced from
``proto/fence/v1/fence.proto`` by grpcio-tools when the package is built (see ``setup.py``);
they are never committed nor edited by hand.
"""
