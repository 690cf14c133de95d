"""Ed25519 signatures on engine artifacts: who may write code that engine pods load.

Artifacts are compile caches, i.e. code the engine runs. A sha256 stored beside the artifact only
proves the bytes match that sidecar, and anyone who can write the bucket can write both. So the
sidecar also carries a signature by a key only the trusted writer holds (the platform team's
``kvfleet artifacts push --signing-key``, or a build Job it runs); engine pods hold only public
keys. Ed25519 rather than an HMAC: an HMAC key verifies *and* signs, so every reader would be a
possible writer.

The signature covers a canonical statement of the artifact's content digest and size and its
identity (the fingerprint, which names engine, version, model digest, GPU, flags), so a valid
artifact copied under another fingerprint's key, or a sidecar edited to claim another identity,
no longer verifies.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvfleet.weight_cache.errors import ArtifactError
from kvfleet.weight_cache.fingerprint import Fingerprint

STATEMENT_SCHEMA = "kvfleet.io/artifact-statement/v1"
# Two keys cover a rotation (old and new trusted at once); a few more leave room, a bound keeps a
# huge ConfigMap from costing every launch a long parse.
MAX_TRUSTED_KEYS = 8
MAX_KEY_FILE_BYTES = 64 << 10
PEM_PUBLIC_BEGIN = "-----BEGIN PUBLIC KEY-----"
PEM_PUBLIC_END = "-----END PUBLIC KEY-----"

# Why an artifact was refused; the launcher's metric label and the phase log's ``refused`` field.
Refusal = Literal["unsigned", "untrusted-key", "bad-signature", "identity-mismatch", "content-mismatch", "no-trust"]
REFUSALS: tuple[Refusal, ...] = (
    "unsigned",
    "untrusted-key",
    "bad-signature",
    "identity-mismatch",
    "content-mismatch",
    "no-trust",
)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short name of a public key for logs and sidecars (not a secret, not a trust decision)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def statement(fp: Fingerprint, sha256: str, size_bytes: int, build_seconds: float | None) -> bytes:
    """The bytes that are signed: canonical JSON (sorted keys, no spaces) of content and identity."""
    doc = {
        "schema": STATEMENT_SCHEMA,
        "fingerprintKey": fp.key,
        "fingerprint": fp.to_wire(),
        "sha256": sha256,
        "sizeBytes": size_bytes,
        "buildSeconds": build_seconds,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ArtifactSigner:
    """The trusted writer's private key. Never constructed in an engine pod the operator renders."""

    private_key: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self.private_key.sign(message)).decode()

    @classmethod
    def from_pem(cls, data: bytes, where: str = "signing key") -> ArtifactSigner:
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            # Never echo the key material: name the file only.
            raise ArtifactError(f"{where}: not an unencrypted PEM private key") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise ArtifactError(f"{where}: not an Ed25519 private key")
        return cls(key)

    @classmethod
    def from_file(cls, path: Path) -> ArtifactSigner:
        try:
            data = path.read_bytes()[: MAX_KEY_FILE_BYTES + 1]
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read the signing key: {e.strerror or e}") from e
        return cls.from_pem(data, str(path))


@dataclass(frozen=True)
class Verdict:
    """A signature check: ``refusal`` is None when it verified; ``reason`` says why either way."""

    refusal: Refusal | None
    reason: str


@dataclass(frozen=True)
class ArtifactTrust:
    """The public keys whose signatures engine pods accept, by key id. Empty trusts nothing."""

    keys: tuple[tuple[str, Ed25519PublicKey], ...] = ()
    source: str = "no trusted keys configured"

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.keys)

    def verify(self, message: bytes, signature: object) -> Verdict:
        """Whether ``signature`` (the sidecar's ``signature`` object) signs ``message`` with a trusted key."""
        if not self.keys:
            return Verdict("no-trust", f"{self.source}: no artifact is loaded unverified")
        if not isinstance(signature, dict) or not signature.get("ed25519"):
            return Verdict("unsigned", "the sidecar carries no signature")
        claimed = str(signature.get("keyId", ""))[:64]
        try:
            raw = base64.b64decode(str(signature["ed25519"]), validate=True)
        except ValueError:
            return Verdict("bad-signature", "the signature is not base64")
        for kid, public in self.keys:
            try:
                public.verify(raw, message)
            except InvalidSignature:
                continue
            return Verdict(None, f"signed by trusted key {kid}")
        trusted = ", ".join(self.key_ids)
        if claimed not in self.key_ids:
            return Verdict(
                "untrusted-key", f"signed by key {claimed or '?'}, which is not trusted (trusted: {trusted})"
            )
        return Verdict(
            "bad-signature", f"the signature by {claimed} does not match this artifact's content and identity"
        )

    @classmethod
    def from_pem(cls, text: str, source: str) -> ArtifactTrust:
        """One or more PEM public keys (``-----BEGIN PUBLIC KEY-----`` blocks), Ed25519 only."""
        blocks: list[str] = []
        rest = text
        while PEM_PUBLIC_BEGIN in rest:
            start = rest.index(PEM_PUBLIC_BEGIN)
            end = rest.find(PEM_PUBLIC_END, start)
            if end < 0:
                raise ArtifactError(f"{source}: a PEM block has no END line")
            blocks.append(rest[start : end + len(PEM_PUBLIC_END)])
            rest = rest[end + len(PEM_PUBLIC_END) :]
        if not blocks:
            raise ArtifactError(f"{source}: no PEM public key ({PEM_PUBLIC_BEGIN})")
        if len(blocks) > MAX_TRUSTED_KEYS:
            raise ArtifactError(f"{source}: {len(blocks)} keys, more than the {MAX_TRUSTED_KEYS} allowed")
        keys: list[tuple[str, Ed25519PublicKey]] = []
        for n, block in enumerate(blocks, 1):
            try:
                public = serialization.load_pem_public_key(block.encode())
            except ValueError as e:
                raise ArtifactError(f"{source}: key {n} is not a valid PEM public key") from e
            if not isinstance(public, Ed25519PublicKey):
                raise ArtifactError(f"{source}: key {n} is not an Ed25519 public key")
            keys.append((key_id(public), public))
        return cls(tuple(keys), source)

    @classmethod
    def from_file(cls, path: Path) -> ArtifactTrust:
        """The keys in ``path``; a missing file trusts nothing (artifacts are then never loaded)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls((), f"no trusted artifact keys at {path}")
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read the trusted artifact keys: {e.strerror or e}") from e
        if len(data) > MAX_KEY_FILE_BYTES:
            raise ArtifactError(f"{path}: more than {MAX_KEY_FILE_BYTES} bytes; not a key file")
        return cls.from_pem(data.decode("utf-8", "replace"), str(path))

    @classmethod
    def of(cls, *public_keys: Ed25519PublicKey, source: str = "given keys") -> ArtifactTrust:
        return cls(tuple((key_id(k), k) for k in public_keys), source)


def public_pem(public_key: Ed25519PublicKey) -> str:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def generate_key_pair(private_path: Path) -> ArtifactSigner:
    """A new signing key, written to ``private_path`` (created 0600, never overwritten)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise ArtifactError(f"{private_path}: exists; a signing key is never overwritten") from e
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return ArtifactSigner(key)
