"""The job's store, kept to the job: an authenticating gate and doors around torch's ``TCPStore``.

torch's ``TCPStore`` lets in whoever connects, and answers ``set``, ``get``, ``list_keys`` and
``num_keys`` to anyone. phalanx keeps it and its protocol untouched and decides who may reach
it at all:

* the store listens on **loopback only**, and its listening socket then requires TCP-MD5
  signatures (RFC 2385) with a key its process alone knows: no other process, not even one
  of this host, can open a connection to it (``inner.py``);
* a **gate** on the master's interface lets in a connection once it has proved the job secret
  (an HMAC challenge both ways, ``handshake.py``), then splices it to the store (``relay.py``);
* a **door** on loopback lets in the connections of known local processes only (a launcher
  and its workers, found by the kernel's socket tables, ``peers.py``) and splices each to the
  store, or to the gate, proving the secret for them: workers need no secret, and a plain
  ``torch.distributed`` script works unchanged.

The files:

``secret.py``     the job secret: drawn, checked, read from a 0600 file.
``handshake.py``  the gate's three-line handshake (HMAC-SHA256 over fresh nonces).
``peers.py``      which process owns the other end of a local TCP connection.
``listen.py``     sockets bound to one interface; keepalive for long-lived links.
``relay.py``      splice, Door, Gate, dial_gate, wait_for_gate.
``inner.py``      InnerStore: the real store, on loopback, locked with TCP-MD5.
``ranks.py``      the store of ranks started without a launcher (srun): bound, or gated.

No module here imports torch at import time (``inner.py`` and ``ranks.py`` do inside their
functions): the launcher imports this package.
"""
