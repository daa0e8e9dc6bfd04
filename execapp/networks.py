"""Lists of IP networks in settings (``['10.0.0.0/8', '::1/128']`` or ``"10.0.0.0/8,::1/128"``): one parser."""
from __future__ import annotations

import ipaddress
from typing import Any, Union

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


def parse_networks(value: Any, source: str, error: type[ValueError] = ValueError) -> tuple[Network, ...]:
    """``value`` (a list or tuple of networks, or their comma-separated text) as networks; raises
    ``error`` naming ``source`` (where the value came from) and the entry that is not a network."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise error(f"{source} is {type(value).__name__} {value!r}: set a list of networks like "
                    "['127.0.0.0/8', '::1/128', '10.0.0.0/8']")
    networks = []
    for entry in value:
        try:
            networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
        except ValueError:
            raise error(f"{source} entry {entry!r} is not a network: write an address or a CIDR network such as "
                        "'10.0.0.0/8' or '::1/128'") from None
    return tuple(networks)
