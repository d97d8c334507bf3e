"""Wire types: the request and response bodies of the protocol (PROTOCOL.md), shared by store and client."""
