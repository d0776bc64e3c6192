"""The ext_proc messages the picker reads and writes, built at import from their field
numbers (Envoy's ``envoy/service/ext_proc/v3/external_processor.proto`` and what it uses).

Why not PyPI's ``xds-protos``: it ships its own copy of OpenTelemetry's protos into the
``opentelemetry.proto`` package, over the files of ``opentelemetry-proto`` that tracing's
OTLP exporter imports (whichever installs last wins: tracing then fails to import). Only
the fields on the wire matter to the protocol: numbers and types are Envoy's (a test checks
them against a listing of Envoy's descriptors), enums are read as the integers they are on
the wire, names are this module's own (a private descriptor pool: nothing clashes with the
real ones if a process loads both).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import (any_pb2, descriptor_pb2, descriptor_pool, duration_pb2,
                             message_factory, struct_pb2, wrappers_pb2)

PACKAGE = "llm_gateway.ext_proc"

# message -> [(number, name, type, oneof or None)]; a type is a scalar name, "repeated X",
# "map X" (string keys) or another message's name.
SCHEMA: dict[str, list[tuple[int, str, str, str | None]]] = {
    "HeaderValue": [(1, "key", "string", None), (2, "value", "string", None),
                    (3, "raw_value", "bytes", None)],
    "HeaderMap": [(1, "headers", "repeated HeaderValue", None)],
    "HeaderValueOption": [(1, "header", "HeaderValue", None),
                          (2, "append", ".google.protobuf.BoolValue", None),
                          (3, "append_action", "int32", None),
                          (4, "keep_empty_value", "bool", None)],
    "Metadata": [(1, "filter_metadata", "map .google.protobuf.Struct", None),
                 (2, "typed_filter_metadata", "map .google.protobuf.Any", None)],
    "ProcessingMode": [(1, "request_header_mode", "int32", None),
                       (2, "response_header_mode", "int32", None),
                       (3, "request_body_mode", "int32", None),
                       (4, "response_body_mode", "int32", None),
                       (5, "request_trailer_mode", "int32", None),
                       (6, "response_trailer_mode", "int32", None)],
    "ProtocolConfiguration": [(1, "request_body_mode", "int32", None),
                              (2, "response_body_mode", "int32", None),
                              (3, "send_body_without_waiting_for_header_response", "bool", None)],
    "HttpHeaders": [(1, "headers", "HeaderMap", None),
                    (2, "attributes", "map .google.protobuf.Struct", None),
                    (3, "end_of_stream", "bool", None)],
    "HttpBody": [(1, "body", "bytes", None), (2, "end_of_stream", "bool", None),
                 (3, "end_of_stream_without_message", "bool", None),
                 (4, "grpc_message_compressed", "bool", None)],
    "HttpTrailers": [(1, "trailers", "HeaderMap", None)],
    "ProcessingRequest": [(2, "request_headers", "HttpHeaders", "request"),
                          (3, "response_headers", "HttpHeaders", "request"),
                          (4, "request_body", "HttpBody", "request"),
                          (5, "response_body", "HttpBody", "request"),
                          (6, "request_trailers", "HttpTrailers", "request"),
                          (7, "response_trailers", "HttpTrailers", "request"),
                          (8, "metadata_context", "Metadata", None),
                          (9, "attributes", "map .google.protobuf.Struct", None),
                          (10, "observability_mode", "bool", None),
                          (11, "protocol_config", "ProtocolConfiguration", None)],
    "HeaderMutation": [(1, "set_headers", "repeated HeaderValueOption", None),
                       (2, "remove_headers", "repeated string", None)],
    "StreamedBodyResponse": [(1, "body", "bytes", None), (2, "end_of_stream", "bool", None),
                             (3, "end_of_stream_without_message", "bool", None),
                             (4, "grpc_message_compressed", "bool", None)],
    "BodyMutation": [(1, "body", "bytes", "mutation"), (2, "clear_body", "bool", "mutation"),
                     (3, "streamed_response", "StreamedBodyResponse", "mutation")],
    "CommonResponse": [(1, "status", "int32", None),
                       (2, "header_mutation", "HeaderMutation", None),
                       (3, "body_mutation", "BodyMutation", None),
                       (4, "trailers", "HeaderMap", None),
                       (5, "clear_route_cache", "bool", None)],
    "HeadersResponse": [(1, "response", "CommonResponse", None)],
    "BodyResponse": [(1, "response", "CommonResponse", None)],
    "TrailersResponse": [(1, "header_mutation", "HeaderMutation", None)],
    "HttpStatus": [(1, "code", "int32", None)],
    "GrpcStatus": [(1, "status", "uint32", None)],
    "ImmediateResponse": [(1, "status", "HttpStatus", None),
                          (2, "headers", "HeaderMutation", None),
                          (3, "body", "bytes", None),
                          (4, "grpc_status", "GrpcStatus", None),
                          (5, "details", "string", None)],
    "ProcessingResponse": [(1, "request_headers", "HeadersResponse", "response"),
                           (2, "response_headers", "HeadersResponse", "response"),
                           (3, "request_body", "BodyResponse", "response"),
                           (4, "response_body", "BodyResponse", "response"),
                           (5, "request_trailers", "TrailersResponse", "response"),
                           (6, "response_trailers", "TrailersResponse", "response"),
                           (7, "immediate_response", "ImmediateResponse", "response"),
                           (8, "dynamic_metadata", ".google.protobuf.Struct", None),
                           (9, "mode_override", "ProcessingMode", None),
                           (10, "override_message_timeout", ".google.protobuf.Duration", None),
                           (11, "request_drain", "bool", None)],
}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "bool": _F.TYPE_BOOL,
            "int32": _F.TYPE_INT32, "uint32": _F.TYPE_UINT32}


def _field(message: descriptor_pb2.DescriptorProto, number: int, name: str, kind: str,
           oneof: str | None) -> None:
    field = message.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
    if kind.startswith("map "):  # map<string, V>: a repeated nested entry message
        entry = message.nested_type.add(name="".join(p.title() for p in name.split("_"))
                                        + "Entry")
        entry.options.map_entry = True
        _field(entry, 1, "key", "string", None)
        _field(entry, 2, "value", kind[4:], None)
        field.label, field.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{message.name}.{entry.name}"
    else:
        if kind.startswith("repeated "):
            field.label, kind = _F.LABEL_REPEATED, kind[9:]
        if kind in _SCALARS:
            field.type = _SCALARS[kind]
        else:
            field.type = _F.TYPE_MESSAGE
            field.type_name = kind if kind.startswith(".") else f".{PACKAGE}.{kind}"
    if oneof is not None:
        names = [o.name for o in message.oneof_decl]
        if oneof not in names:
            message.oneof_decl.add(name=oneof)
            names.append(oneof)
        field.oneof_index = names.index(oneof)


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    for well_known in (any_pb2, duration_pb2, struct_pb2, wrappers_pb2):
        pool.AddSerializedFile(well_known.DESCRIPTOR.serialized_pb)
    file = descriptor_pb2.FileDescriptorProto(
        name="llm_gateway/ext_proc.proto", package=PACKAGE, syntax="proto3",
        dependency=[m.DESCRIPTOR.name for m in (any_pb2, duration_pb2, struct_pb2,
                                                wrappers_pb2)])
    for name, fields in SCHEMA.items():
        message = file.message_type.add(name=name)
        for number, field_name, kind, oneof in fields:
            _field(message, number, field_name, kind, oneof)
    pool.Add(file)
    classes = {name: message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in SCHEMA}
    classes["Struct"] = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("google.protobuf.Struct"))
    return classes


_CLASSES = _build()
HeaderValue = _CLASSES["HeaderValue"]
HeaderMap = _CLASSES["HeaderMap"]
HeaderValueOption = _CLASSES["HeaderValueOption"]
ProcessingMode = _CLASSES["ProcessingMode"]
ProtocolConfiguration = _CLASSES["ProtocolConfiguration"]
HttpHeaders = _CLASSES["HttpHeaders"]
HttpBody = _CLASSES["HttpBody"]
HttpTrailers = _CLASSES["HttpTrailers"]
HttpStatus = _CLASSES["HttpStatus"]
GrpcStatus = _CLASSES["GrpcStatus"]
Metadata = _CLASSES["Metadata"]
ProcessingRequest = _CLASSES["ProcessingRequest"]
HeaderMutation = _CLASSES["HeaderMutation"]
StreamedBodyResponse = _CLASSES["StreamedBodyResponse"]
BodyMutation = _CLASSES["BodyMutation"]
CommonResponse = _CLASSES["CommonResponse"]
HeadersResponse = _CLASSES["HeadersResponse"]
BodyResponse = _CLASSES["BodyResponse"]
TrailersResponse = _CLASSES["TrailersResponse"]
ImmediateResponse = _CLASSES["ImmediateResponse"]
ProcessingResponse = _CLASSES["ProcessingResponse"]
Struct = _CLASSES["Struct"]

# Envoy's enums, as their numbers (ProcessingMode.BodySendMode, HeaderValueOption's
# HeaderAppendAction).
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX = 0, 1, 2, 3, 4
OVERWRITE_IF_EXISTS_OR_ADD = 2

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = f"/{SERVICE}/Process"
