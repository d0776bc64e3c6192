"""The picker's own ext_proc messages (gateway/epp/messages.py) against Envoy's: every field
the picker defines has Envoy's number, type and oneof (enums are their integers on the
wire), and every field Envoy has on those messages is there. The reference is a listing of
xds-protos 1.85.0's descriptors (xds-protos cannot be installed beside OpenTelemetry's
protos: see messages.py)."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2

from gateway.epp import messages

REFERENCE = Path(__file__).with_name("envoy_ext_proc_fields.txt")
F = descriptor_pb2.FieldDescriptorProto
WIRE_TYPE = {"string": "string", "bytes": "bytes", "bool": "bool", "int32": "int32",
             "uint32": "uint32", "enum": "int32", "message": "message"}


def envoy_fields() -> dict[str, dict[int, tuple[str, str, bool, bool]]]:
    """message short name -> number -> (name, type, repeated, in a oneof)."""
    out: dict[str, dict[int, tuple[str, str, bool, bool]]] = {}
    current = ""
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if not line.startswith(" "):
            current = line.rsplit(".", 1)[1]
            out[current] = {}
            continue
        words = line.split()
        number, repeated = int(words[0]), words[1] == "repeated"
        kind, name = words[2:4] if repeated else words[1:3]
        out[current][number] = (name, WIRE_TYPE[kind], repeated, words[-1] == "oneof")
    return out


def picker_fields(name: str) -> dict[int, tuple[str, str, bool, bool]]:
    proto = descriptor_pb2.DescriptorProto()
    getattr(messages, name).DESCRIPTOR.CopyToProto(proto)
    names = {F.TYPE_STRING: "string", F.TYPE_BYTES: "bytes", F.TYPE_BOOL: "bool",
             F.TYPE_INT32: "int32", F.TYPE_UINT32: "uint32", F.TYPE_MESSAGE: "message"}
    return {f.number: (f.name, names[f.type], f.label == F.LABEL_REPEATED,
                       f.HasField("oneof_index")) for f in proto.field}


def test_every_message_has_envoys_fields() -> None:
    reference = envoy_fields()
    assert len(reference) == 21
    for name, fields in reference.items():
        assert picker_fields(name) == fields, name


def test_a_message_built_here_reads_as_envoys_bytes() -> None:
    """Round trip through the wire: a pick's answer, encoded and decoded by field numbers."""
    answer = messages.ProcessingResponse(
        request_headers=messages.HeadersResponse(response=messages.CommonResponse(
            clear_route_cache=True, header_mutation=messages.HeaderMutation(
                set_headers=[messages.HeaderValueOption(header=messages.HeaderValue(
                    key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"),
                    append_action=messages.OVERWRITE_IF_EXISTS_OR_ADD)]))))
    answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value = "10.0.0.1:8000"
    raw = answer.SerializeToString()
    # ProcessingResponse field 1 (request_headers), length-delimited: tag 0x0a.
    assert raw[0] == 0x0A and b"10.0.0.1:8000" in raw
    back = messages.ProcessingResponse.FromString(raw)
    assert back.WhichOneof("response") == "request_headers" and back == answer
