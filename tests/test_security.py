"""TLS, mutual TLS and bearer-token auth on the coordinator; mTLS between the
coordinator and the model services; no prompt text in the logs."""
from __future__ import annotations

import logging

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

import drafter.service
import verifier.service
from coordinator.service import CoordinatorConfig, serve as serve_coordinator
from specdec.rpc.errors import SpecdecError
from specdec.rpc.security import ClientTls, ServerTls, is_loopback, load_token
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import rpc_error, served_coordinator

TOKEN = "s3cret-token-for-tests"
REQUEST = pb.GenerateRequest(prompt="The quick brown fox", max_new_tokens=6)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, and client certificates
    from that CA and from an unrelated one, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    files = {"ca": ca.cert_pem, "other_ca": other_ca.cert_pem}
    for name, issuer, identities in (("server", ca, ["127.0.0.1", "localhost"]), ("client", ca, ["client"]),
                                     ("other_client", ca, ["other-client"]),
                                     ("stranger", other_ca, ["stranger"])):
        cert = issuer.issue_cert(*identities)
        files[name + "_cert"] = cert.cert_chain_pems[0]
        files[name + "_key"] = cert.private_key_pem
    paths = {}
    for name, blob in files.items():
        path = root / f"{name}.pem"
        blob.write_to_path(str(path))
        paths[name] = str(path)
    return paths


def backends(stack) -> dict:
    return {"drafter": stack.address(stack.drafter), "verifier": stack.address(stack.verifier)}


def call(address: str, tls: ClientTls | None = None, token: str | None = None, metadata=()) -> pb.GenerateResponse:
    with channel(address, tls, token) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).Generate(REQUEST, timeout=30, metadata=metadata)


def test_tls_serves_clients_that_trust_the_ca_and_no_others(stack, pki):
    tls = ServerTls(pki["server_cert"], pki["server_key"])
    with served_coordinator(**backends(stack), tls=tls) as c:
        assert len(call(c.address, ClientTls(ca=pki["ca"])).token_ids) > 0
        untrusted = rpc_error(call, c.address, ClientTls(ca=pki["other_ca"]))
        assert untrusted.code() == grpc.StatusCode.UNAVAILABLE
        plaintext = rpc_error(call, c.address)
        assert plaintext.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(stack, pki):
    tls = ServerTls(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    with served_coordinator(**backends(stack), tls=tls) as c:
        ok = call(c.address, ClientTls(pki["ca"], pki["client_cert"], pki["client_key"]))
        assert len(ok.token_ids) > 0
        for client in (ClientTls(pki["ca"]), ClientTls(pki["ca"], pki["stranger_cert"], pki["stranger_key"])):
            assert rpc_error(call, c.address, client).code() == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_required_on_generate_but_not_on_health(stack):
    with served_coordinator(**backends(stack), auth_token=TOKEN) as c:
        assert len(call(c.address, token=TOKEN).token_ids) > 0
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            error = rpc_error(call, c.address, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <token>" in error.details()
        with channel(c.address) as ch:
            stream = coordinator_pb2_grpc.CoordinatorStub(ch).GenerateStream(REQUEST, timeout=30)
            assert rpc_error(list, stream).code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_token_over_tls_and_from_env_or_file(stack, pki, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_TEST_TOKEN", f"  {TOKEN}\n")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert load_token(env="SPECDEC_TEST_TOKEN") == TOKEN == load_token(file=str(token_file))
    monkeypatch.setenv("SPECDEC_EMPTY", "")
    with pytest.raises(ValueError, match="empty"):
        load_token(env="SPECDEC_EMPTY")
    with pytest.raises(ValueError, match="cannot read auth token file"):
        load_token(file=str(tmp_path / "missing"))
    tls = ServerTls(pki["server_cert"], pki["server_key"])
    with served_coordinator(**backends(stack), tls=tls, auth_token=TOKEN) as c:
        assert len(call(c.address, ClientTls(ca=pki["ca"]), token=TOKEN).token_ids) > 0
        error = rpc_error(call, c.address, ClientTls(ca=pki["ca"]), token="nope")
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_model_services_over_mutual_tls(tiny_draft, tiny_target, pki):
    server_tls = ServerTls(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    servers = [drafter.service.serve(tiny_draft, tls=server_tls), verifier.service.serve(tiny_target, tls=server_tls)]
    try:
        addresses = {"drafter": f"127.0.0.1:{servers[0].port}", "verifier": f"127.0.0.1:{servers[1].port}"}
        client = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
        with served_coordinator(**addresses, backend_tls=client) as c:
            fixed = pb.GenerateRequest(prompt=REQUEST.prompt, max_new_tokens=6, speculation=pb.Speculation(gamma=4))
            response = c.stub.Generate(fixed, timeout=30)
            assert response.stats.draft_tokens > 0  # a fixed γ drafts, whatever this machine's costs
        with pytest.raises(TimeoutError, match="not SERVING"):  # without a client certificate: no handshake
            serve_coordinator(CoordinatorConfig(**addresses, backend_tls=ClientTls(pki["ca"]), connect_timeout_s=2))
    finally:
        for server in servers:
            server.stop(0)


def test_model_services_refuse_to_serve_off_loopback_without_mtls_or_a_token(tiny_draft, caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ValueError, match="without mutual TLS or a bearer token"):
        drafter.service.serve(tiny_draft, host="0.0.0.0")
    with caplog.at_level(logging.WARNING):
        drafter.service.serve(tiny_draft, host="0.0.0.0", auth_token=TOKEN).stop(0)  # a token will do
        drafter.service.serve(tiny_draft).stop(0)  # loopback without one: any local user may call it
    assert "takes calls from any local user" in caplog.text


def test_model_services_over_tcp_require_the_coordinators_token(tiny_draft, tiny_target):
    servers = [drafter.service.serve(tiny_draft, auth_token=TOKEN), verifier.service.serve(tiny_target,
                                                                                           auth_token=TOKEN)]
    try:
        addresses = {"drafter": f"127.0.0.1:{servers[0].port}", "verifier": f"127.0.0.1:{servers[1].port}"}
        stubs = {"drafter": drafter_pb2_grpc.DrafterStub, "verifier": verifier_pb2_grpc.VerifierStub}
        for name, address in addresses.items():
            with channel(address) as ch:  # a local user without the token
                error = rpc_error(stubs[name](ch).StartSession, common_pb2.StartSessionRequest(
                    session_id="intruder", prompt_token_ids=[1, 2, 3]), timeout=5)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
        with served_coordinator(**addresses, backend_auth_token=TOKEN) as c:
            fixed = pb.GenerateRequest(prompt=REQUEST.prompt, max_new_tokens=6, speculation=pb.Speculation(gamma=4))
            assert c.stub.Generate(fixed, timeout=30).stats.draft_tokens > 0
        with pytest.raises(SpecdecError, match="refused the call: missing or wrong bearer token"):  # one without it
            serve_coordinator(CoordinatorConfig(**addresses, connect_timeout_s=2))
    finally:
        for server in servers:
            server.stop(0)


def test_no_prompt_text_in_logs_by_default(stack, caplog):
    secret = "my confidential prompt about zebras"
    with caplog.at_level(logging.DEBUG):
        with served_coordinator(**backends(stack)) as c:
            c.stub.Generate(pb.GenerateRequest(prompt=secret, max_new_tokens=4), timeout=30)
            rpc_error(c.stub.Generate, pb.GenerateRequest(prompt=secret, max_new_tokens=0), timeout=30)
    assert "prompt tokens ->" in caplog.text  # the request was logged, as counts
    assert "zebras" not in caplog.text
    with caplog.at_level(logging.INFO):
        with served_coordinator(**backends(stack), log_prompts=True) as c:
            c.stub.Generate(pb.GenerateRequest(prompt=secret, max_new_tokens=4), timeout=30)
    assert "zebras" in caplog.text  # opted in


def test_a_bearer_token_over_plaintext_off_loopback_is_warned_about(stack, caplog):
    with caplog.at_level(logging.WARNING):
        running, watched = serve_coordinator(CoordinatorConfig(**backends(stack), auth_token="secret",
                                                               connect_timeout_s=30), host="0.0.0.0")
        watched.close()
        running.stop(0)
    assert "serving a bearer token over plaintext on 0.0.0.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # on loopback it stays on this machine: no warning
        with served_coordinator(**backends(stack), auth_token="secret"):
            pass
    assert "bearer token over plaintext" not in caplog.text


def test_a_public_bind_without_authentication_is_warned_about(stack, caplog):
    with caplog.at_level(logging.WARNING):
        running, watched = serve_coordinator(CoordinatorConfig(**backends(stack), connect_timeout_s=30),
                                             host="0.0.0.0")
        watched.close()
        running.stop(0)
    assert "serving 0.0.0.0 without authentication" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a token (the plaintext warning aside), or loopback: no such warning
        running, watched = serve_coordinator(CoordinatorConfig(**backends(stack), auth_token="secret",
                                                               connect_timeout_s=30), host="0.0.0.0")
        watched.close()
        running.stop(0)
        with served_coordinator(**backends(stack)):
            pass
    assert "without authentication" not in caplog.text


def test_a_model_service_on_a_unix_socket_in_a_private_directory(tiny_draft, tmp_path, caplog):
    path = tmp_path / "private" / "drafter.sock"
    with caplog.at_level(logging.WARNING):
        running = drafter.service.serve(tiny_draft, uds=str(path))
    try:
        assert running.address == f"unix:{path}" and running.port == 0
        assert (path.parent.stat().st_mode & 0o777) == 0o700 and "other local users" not in caplog.text
        with channel(running.address) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop(0)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        drafter.service.serve(tiny_draft, uds=str(shared / "drafter.sock")).stop(0)
    assert "other local users may reach it" in caplog.text


def ngram_accepted(response: pb.GenerateResponse) -> int:
    return sum(s.accepted_tokens for s in response.stats.draft_sources if s.source == "ngram")


def test_recent_outputs_are_searched_only_by_the_caller_that_wrote_them(stack, pki):
    """With cross-request lookups on, a caller's lookups find its own earlier
    outputs, never another caller's: what a lookup drafts shows in timing and
    stats. Lookups alone at a fixed γ, so what is drafted is the tokens' doing."""
    tls = ServerTls(pki["server_cert"], pki["server_key"], client_ca=pki["ca"])
    alice = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
    bob = ClientTls(pki["ca"], pki["other_client_cert"], pki["other_client_key"])
    request = pb.GenerateRequest(prompt="The quick brown fox jumps", max_new_tokens=48, ignore_eos=True,
                                 speculation=pb.Speculation(gamma=4))

    def generate(address: str, who: ClientTls) -> pb.GenerateResponse:
        with channel(address, who) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).Generate(request, timeout=30)
    with served_coordinator(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram", tls=tls,
                            lookup_history_tokens=4096) as c:
        first = generate(c.address, alice)
        others = generate(c.address, bob)       # the same prompt, so alice's output would be its continuation
        again = generate(c.address, alice)
    assert list(first.token_ids) == list(others.token_ids) == list(again.token_ids)
    assert ngram_accepted(others) == ngram_accepted(first)    # bob's lookups saw bob's tokens only
    assert list(others.stats.draft_sources) == list(first.stats.draft_sources)
    assert ngram_accepted(again) > ngram_accepted(first)      # alice's found her own earlier output


def test_recent_outputs_are_searched_only_under_the_salt_they_were_written_under(stack):
    """The same caller under another cache_salt finds nothing of what it wrote
    under the first (as the prefix caches), and finds it again under the first."""
    def request(salt: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt="The quick brown fox jumps", max_new_tokens=48, ignore_eos=True,
                                  cache_salt=salt, speculation=pb.Speculation(gamma=4))
    with served_coordinator(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram",
                            lookup_history_tokens=4096) as c:
        first = c.stub.Generate(request("s1"), timeout=30)
        other_salt = c.stub.Generate(request("s2"), timeout=30)
        same_salt = c.stub.Generate(request("s1"), timeout=30)
    assert list(first.token_ids) == list(other_salt.token_ids) == list(same_salt.token_ids)
    assert ngram_accepted(other_salt) == ngram_accepted(first)
    assert ngram_accepted(same_salt) > ngram_accepted(first)
