"""Domain errors and the one place they become gRPC status codes.

Services raise these (or let a downstream grpc.RpcError through); the
`StatusInterceptor` turns them into a status with the message unchanged, so a
servicer never calls `context.abort` itself.
"""
from __future__ import annotations

import logging
import uuid

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    """`param`: the request field at fault, as the gRPC API names it (the HTTP front
    reports it in OpenAI's `error.param`); None where no one field is."""
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


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
    """A downstream service's failure, with its status code kept and a message fit
    for public clients (see `public_message`)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        super().__init__(message)


# Codes whose details come from gRPC's transport (they name addresses) or from a
# crash, not from the service's own checks: public clients get a fixed text.
TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


ECHO_CHARS = 48          # of a client's own input, what an error message repeats ...
MAX_STATUS_CHARS = 4096  # ... and the most any status message or its log line carries (gRPC's metadata: 16 KB)


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as an error message may echo it: its repr, cut to `limit` characters
    with its length said (a 3 MB role echoed whole overflowed gRPC's 16 KB metadata,
    which turned INVALID_ARGUMENT into RESOURCE_EXHAUSTED, and filled the log)."""
    try:
        text = repr(value)
    except RecursionError:   # a JSON value nested deeper than repr goes
        return f"<a {type(value).__name__} nested too deep to show>"
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters as text"
    return f"{text[:limit]}... ({size})"


def unavailable_message(service: str) -> str:
    """The one text a client sees when `service` is down, at the start or mid-stream."""
    return f"the {service} is unavailable; retry shortly"


def public_message(service: str, code: grpc.StatusCode, details: str) -> str:
    """What a public client is told of a backend's failure: what failed and what to
    do, never an internal address (those go to the log and the trace)."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable_message(service)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the deadline passed while the {service} was working; raise the client's timeout"
    if code == grpc.StatusCode.CANCELLED:
        return f"the call to the {service} was cancelled"
    if code in TRANSPORT_CODES:
        return f"the {service} failed ({code.name}); retry, and see the coordinator's log if it persists"
    return f"the {service} refused the call: {details}"


def report_internal(exc: BaseException, what: str, service: str = "service",
                    logger: logging.Logger = log) -> tuple[str, str]:
    """An unexpected failure's error id and what the caller is told of it: the traceback
    goes to the log under the id, never to the caller (paths, shapes, internal names)."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("%s failed (error id %s)", what, error_id, exc_info=exc)
    return error_id, (f"internal error (error id {error_id}): the {service} failed on this call; retry, and if it "
                      f"persists report the error id (the {service}'s log has the details under it)")


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    """Ends the call with the status the caller should see for `exc`. An unexpected
    exception's text (paths, tensor shapes, internal names) is never sent: the
    caller gets an error id to report, and the log and the span the traceback under it."""
    if isinstance(exc, SpecdecError):
        code, message = exc.code, str(exc)
    elif isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # A downstream service failed: pass its code on, say which call it was.
        code, message = exc.code(), exc.details() or str(exc)
    else:
        error_id, message = report_internal(exc, method)
        span = trace.get_current_span()
        span.record_exception(exc)
        span.set_attribute("specdec.error_id", error_id)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__} (error id {error_id})"))
        return context.abort(grpc.StatusCode.INTERNAL, message)  # (abort raises: the call ends here)
    if len(message) > MAX_STATUS_CHARS:   # a backstop: messages clip what they echo (clip)
        message = message[:MAX_STATUS_CHARS] + f"... ({len(message):,} characters)"
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s: %s: %s", method, code.name, message)
    context.abort(code, message)


class _Malformed:
    """What the deserializer hands on for bytes that do not parse, so the handler
    can refuse them with INVALID_ARGUMENT (grpc would say INTERNAL)."""

    def __init__(self, message: str):
        self.message = message


def _lenient(deserializer, method: str):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, upb sometimes others
            return _Malformed(f"the request to {method} is not a valid protobuf message "
                              f"({type(exc).__name__}: {exc}); check that the client was generated "
                              "from the same protos (specdec.v1) and that string fields hold UTF-8")
    return parse


def _refuse_malformed(request) -> None:
    if isinstance(request, _Malformed):
        raise InvalidArgument(request.message)


class StatusInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by any handler (unary or streaming) to a status,
    and request bytes that do not parse to INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(fn):
            def call(request, context):
                try:
                    _refuse_malformed(request)
                    return fn(request, context)
                except Exception as exc:  # noqa: BLE001 - this is the mapping point
                    _abort(context, exc, method)
            return call

        def wrap_stream(fn):
            def call(request, context):
                try:
                    _refuse_malformed(request)
                    yield from fn(request, context)
                except Exception as exc:  # noqa: BLE001
                    _abort(context, exc, method)
            return call

        parse = _lenient(handler.request_deserializer, method)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), parse, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), parse, handler.response_serializer)
        return handler
