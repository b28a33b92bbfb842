"""The job secret: where it comes from, and what a usable one looks like.

A launcher of one node draws its own (:func:`new_secret`); the launchers of several nodes
must share one, given as ``PHALANX_JOB_SECRET`` (read by :func:`phalanx.env.job_secret`) or
as a file readable by its owner only (:func:`read_secret_file`). Workers started without a
launcher (``srun``, a script's own ``mp.spawn``) read ``PHALANX_JOB_SECRET`` too.
"""

from __future__ import annotations

import os
import secrets
import stat

# Below 16 characters a secret is guessable by brute force over the network in a job's
# lifetime; 16 hex digits are 64 bits. new_secret() draws 32 bytes (64 hex digits).
MIN_SECRET_CHARS = 16
_NEW_SECRET_BYTES = 32
HOW_TO_MAKE = "e.g. export PHALANX_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
# The same for the pods of a Kubernetes job (PET_* variables): one Secret, in every pod's env
# (docs/launching.md, "Kubernetes").
ON_KUBERNETES = (
    "on Kubernetes, one Secret for every pod: kubectl create secret generic phalanx-job "
    "--from-literal=secret=$(python3 -c 'import secrets; print(secrets.token_hex(32))'), and in "
    "the container: env: [{name: PHALANX_JOB_SECRET, valueFrom: {secretKeyRef: {name: "
    "phalanx-job, key: secret}}}]")


def new_secret() -> str:
    """A fresh random secret (64 hex digits)."""
    return secrets.token_hex(_NEW_SECRET_BYTES)


def check_secret(value: str, origin: str, error: type[Exception] = ValueError) -> bytes:
    """``value`` as the key the handshake uses, or ``error`` saying what is wrong with it.

    Args:
        value: the secret as given (surrounding whitespace is dropped).
        origin: where it came from, for the message (``"PHALANX_JOB_SECRET"``, a file name).
        error: the exception class to raise (a ``ValueError`` subclass).
    """
    text = value.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise error(
            f"The job secret from {origin} has {len(text)} characters; expected at least "
            f"{MIN_SECRET_CHARS} ({HOW_TO_MAKE})"
        )
    return text.encode()


def read_secret_file(path: str, error: type[Exception] = ValueError) -> str:
    """The secret held in ``path``, a regular file of this user that no one else may read
    or write (mode 0600 or 0400), as ssh insists for its keys.

    Raises:
        error: the file is missing, not a regular file, someone else's, or open to others.
    """
    try:
        info = os.stat(path)
    except OSError as e:
        raise error(f"Cannot read the job secret file {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"The job secret file {path!r} is not a regular file")
    if info.st_uid != os.geteuid():
        raise error(f"The job secret file {path!r} belongs to uid {info.st_uid}, not to this "
                    f"user ({os.geteuid()})")
    if info.st_mode & 0o077:
        raise error(
            f"The job secret file {path!r} has mode {stat.S_IMODE(info.st_mode):04o}: others "
            f"may read or change it; expected 0600 (chmod 600 {path})"
        )
    with open(path) as f:
        return f.read()
