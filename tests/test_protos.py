"""The committed gRPC code is what the .proto files generate."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_services_expose_health_and_reflection(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from specdec.rpc.serving import channel
    for server, name in ((stack.coordinator, "specdec.v1.Coordinator"), (stack.drafter, "specdec.v1.Drafter"),
                         (stack.verifier, "specdec.v1.Verifier")):
        with channel(stack.address(server)) as ch:
            services = ProtoReflectionDescriptorDatabase(ch).get_services()
            assert name in services and "grpc.health.v1.Health" in services
