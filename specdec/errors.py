"""Domain errors and the one place they become gRPC status codes.

Services raise these (or let a downstream grpc.RpcError through); the
`StatusInterceptor` turns them into a status with the message unchanged, so a
servicer never calls `context.abort` itself.
"""
from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecdecError):
    code = grpc.StatusCode.CANCELLED


class RemoteError(SpecdecError):
    """A downstream service's failure, with its status code kept."""

    def __init__(self, service: str, exc: grpc.RpcError):
        self.code = exc.code()
        super().__init__(f"{service}: {exc.details() or exc.code().name}")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a caller should see for `exc`."""
    if isinstance(exc, SpecdecError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # A downstream service failed: pass its code on, say which call it was.
        return exc.code(), exc.details() or str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s: %s: %s", method, code.name, message)
    context.abort(code, message)


class StatusInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by any handler (unary or streaming) to a status."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(fn):
            def call(request, context):
                try:
                    return fn(request, context)
                except Exception as exc:  # noqa: BLE001 - this is the mapping point
                    _abort(context, exc, method)
            return call

        def wrap_stream(fn):
            def call(request, context):
                try:
                    yield from fn(request, context)
                except Exception as exc:  # noqa: BLE001
                    _abort(context, exc, method)
            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return handler
