"""Reads Kafka records (JSON lines on stdin: headers, key and value in base64) with
the CloudEvents Python SDK's Kafka binding, which tells the binary from the
structured mode by itself, and prints each event's attributes and data as one JSON
line. An independent reader: the relay's records must parse with it."""

import base64
import json
import sys

from cloudevents.core.bindings.kafka import KafkaMessage, from_kafka
from cloudevents.core.formats.json import JSONFormat


def main() -> None:
    for line in sys.stdin:
        record = json.loads(line)
        message = KafkaMessage(
            headers={k: base64.b64decode(v) for k, v in record["headers"].items()},
            key=base64.b64decode(record["key"]) if record["key"] is not None else None,
            value=base64.b64decode(record["value"]),
        )
        event = from_kafka(message, JSONFormat())
        attributes = event.get_attributes()
        data = event.get_data()
        if isinstance(data, (bytes, bytearray)):
            data = {"base64": base64.b64encode(data).decode()}
        out = {
            "specversion": attributes.get("specversion"),
            "id": attributes.get("id"),
            "source": attributes.get("source"),
            "type": attributes.get("type"),
            "time": attributes["time"].isoformat() if attributes.get("time") else None,
            "datacontenttype": attributes.get("datacontenttype"),
            "data": data,
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
