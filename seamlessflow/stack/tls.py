"""`seamlessflow up --tls`: a private CA and the certificates the stack's NATS, Redis and services use.

    files = ensure(data_dir / "tls")     # made with the `openssl` CLI on the first run, reused after
    files.settings()                     # SF_NATS_TLS_* and SF_REDIS_TLS_* for the services

One CA signs a server certificate (for localhost, 127.0.0.1 and this machine's name: both servers
present it), a route certificate (the same names; nats-server cluster members present it to each
other, as server and as client) and a client certificate (every service presents it: the servers
verify clients).
Private keys are 0600 from the moment they exist (the file is made empty, 0600, before openssl
writes into it). Nothing here reads, prints or logs a key; openssl's own output goes to an error
message only when it fails. The CA's key stays in the directory, so a rerun can sign a missing
certificate again; an operator who wants the CA offline makes the files with their own CA instead
and sets the SF_*_TLS_* settings by hand.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

DAYS = 825  # the longest validity some TLS clients accept for a leaf certificate
CURVE = "prime256v1"  # EC keys: made in milliseconds, accepted by nats-server, Redis and Python's ssl


class TlsError(RuntimeError):
    pass


@dataclass(frozen=True)
class TlsFiles:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.dir / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def route_cert(self) -> Path:  # nats-server cluster members: presented both ways on a route
        return self.dir / "route.crt"

    @property
    def route_key(self) -> Path:
        return self.dir / "route.key"

    @property
    def client_cert(self) -> Path:
        return self.dir / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"

    def settings(self, nats: bool = True, redis: bool = True) -> dict[str, str]:
        """The services' SF_NATS_TLS_* and SF_REDIS_TLS_* (paths only: no secret is in them)."""
        out = {}
        for prefix, on in (("SF_NATS_TLS", nats), ("SF_REDIS_TLS", redis)):
            if on:
                out |= {f"{prefix}_CA": str(self.ca), f"{prefix}_CERT": str(self.client_cert),
                        f"{prefix}_KEY": str(self.client_key)}
        return out


def ensure(dir: Path, hosts: tuple[str, ...] = ()) -> TlsFiles:
    """The CA, server and client certificates in `dir`: those there are kept, the missing ones made.
    `hosts`: more names the server certificate is for (besides localhost, 127.0.0.1, this machine)."""
    files = TlsFiles(dir)
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsError("--tls makes its certificates with the openssl command, which is not installed "
                       "(apt-get install -y openssl)")
    dir.mkdir(parents=True, exist_ok=True)
    os.chmod(dir, 0o700)
    ca_key = dir / "ca.key"
    if not (files.ca.exists() and ca_key.exists()):
        _run(openssl, "req", "-x509", *_new_key(ca_key), "-days", str(DAYS), "-subj", "/CN=SeamlessFlow stack CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", str(files.ca))
        for leaf in (files.server_cert, files.route_cert, files.client_cert):  # signed by an older CA: make them again
            leaf.unlink(missing_ok=True)
    names = ["DNS:localhost", "IP:127.0.0.1", f"DNS:{socket.gethostname()}"]
    names += [f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts]
    _leaf(openssl, files, files.server_cert, files.server_key, "SeamlessFlow server", "serverAuth",
          "subjectAltName=" + ",".join(dict.fromkeys(names)))
    # a cluster member dials its peers' route ports and is dialled by them: one certificate for both
    _leaf(openssl, files, files.route_cert, files.route_key, "SeamlessFlow NATS route", "serverAuth,clientAuth",
          "subjectAltName=" + ",".join(dict.fromkeys(names)))
    _leaf(openssl, files, files.client_cert, files.client_key, "SeamlessFlow service", "clientAuth", "")
    return files


def _leaf(openssl: str, files: TlsFiles, cert: Path, key: Path, cn: str, usage: str, extra: str) -> None:
    if cert.exists() and key.exists():
        return
    with tempfile.TemporaryDirectory(dir=files.dir) as tmp:
        csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        ext.write_text(f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
                       "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
                       + (extra + "\n" if extra else ""))
        _run(openssl, "req", "-new", *_new_key(key), "-subj", f"/CN={cn}", "-out", str(csr))
        _run(openssl, "x509", "-req", "-in", str(csr), "-CA", str(files.ca), "-CAkey", str(files.dir / "ca.key"),
             "-CAcreateserial", "-days", str(DAYS), "-sha256", "-extfile", str(ext), "-out", str(cert))


def _new_key(key: Path) -> list[str]:
    """openssl arguments for a new EC key written to `key`, made empty and 0600 first."""
    key.unlink(missing_ok=True)
    os.close(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return ["-newkey", "ec", "-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-nodes", "-keyout", str(key)]


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:  # openssl prints no key material: its errors are safe to show
        raise TlsError(f"openssl {argv[1]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
