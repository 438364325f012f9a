"""How payload becomes bytes on a link and in a host's interface counter.

Measured on the simulated hosts of :mod:`lightning_parallel.cluster.network` (Linux 6.18,
torch 2.13 gloo; ``tests/plan/test_network.py`` re-measures it):

* every TCP segment carries ``66`` header bytes: Ethernet 14 + IPv4 20 + TCP 20 + timestamp
  option 12; the MSS at MTU 1500 is ``1448`` (``OutSegs · 1448`` = the payload sent, within
  0.1%, on a 4 MB send);
* ``tc`` (``tbf``) shapes layer-2 bytes *per segment* even for GSO super-packets, so a link of
  ``B`` bits/s carries ``b = B/8 · 1448/1514`` payload bytes/s (a 4 MB send at 100mbit took
  0.334 s, the law says 0.3346 s; without the framing it would be 0.320 s);
* the interface counter ``tx_bytes`` counts what the kernel hands the veth: GSO super-packets
  of up to 45 segments (65160 payload bytes, measured 53-65 kB a packet at 100mbit-1gbit),
  each with *one* 66-byte header, and the receiver sends one 66-byte ACK per packet it gets
  (60 ACKs for 61 packets of a 4 MB send); so on the simulated hosts
  ``tx_bytes ≈ payload · (1 + 66/65160) + received · 66/65160``, about 0.1% of framing.
  A real NIC that counts every segment sees ``66/1448`` (4.6%) instead, and ACKs every second
  segment: :data:`ETHERNET`;
* gloo adds about 130 bytes a message sent (its preamble) and a notification of about as much
  for each message received, each in a packet of its own: 186 to 204 bytes a message sent or
  received, headers included, counted on all-reduces of 2 kB and 32 kB on 2, 4 and 8 hosts
  (each a ring of gloo's segments,
  :func:`~lightning_parallel.plan.network.ring_segments`: 8 to 56 messages a host).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__: list[str] = []

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12
SEGMENT_BYTES = 1448  # MSS at MTU 1500 with TCP timestamps


@dataclass(frozen=True)
class Framing:
    """How payload becomes bytes on the link (shaped) and in the interface counter (counted).

    Args:
        header_bytes: headers on every segment and packet.
        segment_bytes: payload a TCP segment (the MSS): ``tc`` shapes per segment.
        packet_bytes: payload a packet the counter counts (a GSO super-packet on veth; one
            segment on a NIC that counts segments). Larger => less framing counted.
        packets_per_ack: packets received per ACK sent. Larger => fewer ACK bytes.
        message_bytes: protocol bytes (gloo's preamble and ready notification) a message.
    """

    header_bytes: int = HEADER_BYTES
    segment_bytes: int = SEGMENT_BYTES
    packet_bytes: int = 45 * SEGMENT_BYTES
    packets_per_ack: float = 1.0
    message_bytes: int = 130

    def __post_init__(self) -> None:
        if min(self.segment_bytes, self.packet_bytes) <= 0 or self.packets_per_ack <= 0:
            raise ValueError(f"framing sizes and packets_per_ack must be positive: {self}")

    @property
    def shaping_factor(self) -> float:
        """Layer-2 bytes the shaper counts per payload byte: ``(MSS + header) / MSS``."""
        return (self.segment_bytes + self.header_bytes) / self.segment_bytes

    def receiver_acks(self, nbytes: float) -> float:
        """Bytes of the ACKs a receiver of one ``nbytes`` message sends: one a
        ``packets_per_ack`` packets, at least one."""
        return self.header_bytes * max(1.0, nbytes / (self.packet_bytes * self.packets_per_ack))


VETH = Framing()
"""The simulated hosts' veth counters (GSO packets of 45 segments, one ACK a packet)."""

ETHERNET = Framing(packet_bytes=SEGMENT_BYTES, packets_per_ack=2.0)
"""A NIC counting every 1448-byte segment, the receiver ACKing every second one."""


def wire_bytes(
    payload_sent: float,
    payload_received: float,
    messages_sent: float = 0,
    messages_received: float = 0,
    framing: Framing = VETH,
) -> float:
    """Bytes a host's ``tx_bytes`` counts for what it sends and receives.

    ``sent + G · (m_s + m_r) + H · (sent/P + m_s + m_r + received/(P · A))`` with ``H`` the
    header bytes, ``P`` payload a counted packet, ``A`` packets per ACK, ``G`` gloo's bytes a
    message, ``m_s``/``m_r`` messages sent/received: each message sent is at least one packet
    with gloo's preamble, each one received costs a ready notification of its own packet.
    """
    f = framing
    packets = payload_sent / f.packet_bytes + messages_sent + messages_received
    acks = payload_received / (f.packet_bytes * f.packets_per_ack)
    return (
        payload_sent
        + f.header_bytes * (packets + acks)
        + f.message_bytes * (messages_sent + messages_received)
    )
