"""Real servers on loopback for the remote-shard tests, and a fault proxy in front of them.

- :class:`RangeHTTPServer`: Python's ``http.server`` serving a folder, with byte ranges (fsspec's HTTP
  files read by range; the stock handler ignores the Range header);
- :func:`moto_s3`: moto's S3 in server mode (a real HTTP S3 endpoint, read through s3fs);
- :class:`FaultProxy`: a TCP proxy that injects ``times`` faults, then passes everything through --
  ``drop`` (close a connection once it has carried ``after`` response bytes), ``503`` (answer a
  connection's first request with 503 and close it), ``stall`` (stop a connection after ``after`` bytes
  for ``stall`` seconds, then close it).
Everything binds 127.0.0.1 only."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# fake credentials for moto, and no probing of the EC2 metadata address (169.254.169.254)
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores and CDNs
    _remaining = None

    def log_message(self, *args) -> None:
        pass

    def send_head(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            return super().send_head()
        f = open(path, "rb")  # noqa: SIM115 (closed by the base class after copyfile)
        size = os.fstat(f.fileno()).st_size
        start, end = 0, size - 1
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, size - int(b))
            end = min(int(b), size - 1) if a and b else size - 1
            if start >= size:
                f.close()
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        f.seek(start)
        self._remaining = end - start + 1
        return f

    def copyfile(self, source, outputfile) -> None:
        left = self._remaining
        while left:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a client (or the fault proxy) hung up mid-answer: expected here


class RangeHTTPServer:
    def __init__(self, root: Path):
        handler = lambda *a, **k: _RangeHandler(*a, directory=str(root), **k)  # noqa: E731
        self.httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def moto_s3(monkeypatch, bucket: str, folder: Path, prefix: str):
    """moto's S3 server on 127.0.0.1 with ``folder``'s files uploaded under ``s3://bucket/prefix/``;
    fake credentials, and no probing of the EC2 metadata address."""
    import boto3
    from moto.server import ThreadedMotoServer

    for k, v in FAKE_AWS.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
        s3.create_bucket(Bucket=bucket)
        for f in sorted(folder.iterdir()):
            if f.is_file():
                s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")
        yield port
    finally:
        server.stop()


class FaultProxy:
    def __init__(self, upstream_port: int, fault: str | None = None, after: int = 0, times: int = 0,
                 stall: float = 0.0):
        assert fault in (None, "drop", "503", "stall")
        self.upstream = ("127.0.0.1", upstream_port)
        self.fault, self.after, self.times, self.stall = fault, after, times, stall
        self.connections = 0
        self.faults = 0  # faults actually injected
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        with self.lock:
            self.connections += 1
        try:
            if self.fault == "503" and self._take():
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 0\r\n"
                               b"Connection: close\r\n\r\n")
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, up), daemon=True).start()
            sent = 0
            while True:
                data = up.recv(65536)
                if not data:
                    break
                if self.fault in ("drop", "stall") and sent + len(data) > self.after and self._take():
                    client.sendall(data[: self.after - sent])
                    if self.fault == "stall":
                        time.sleep(self.stall)
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (client, locals().get("up")):
                if sock is not None:
                    try:  # shutdown first: it sends the FIN now and wakes the pump blocked in recv
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()

    def _take(self) -> bool:
        """Whether to inject a fault now (the first ``times`` chances)."""
        with self.lock:
            if self.faults < self.times:
                self.faults += 1
                return True
            return False

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
