"""Generated Python stubs of the kubelet's pod-resources API, v1: do not edit.

``api_pb2.py`` (messages), ``api_pb2.pyi`` (their types) and ``api_pb2_grpc.py`` (the
``PodResourcesLister`` stub and servicer) are written by grpcio-tools from the vendored
``daemon/polca/assign/proto/podresources_v1.proto`` with ``scripts/gen-podresources.sh``,
which also makes the servicer module's import of ``api_pb2`` package-relative. Regenerate
them with that script after changing the proto or upgrading grpcio-tools;
``tests/assign/test_podresources.py::test_stubs_are_current`` fails until they are.
Only ``polca.assign.podresources`` (and the tests' kubelet stand-in) import them.
"""
