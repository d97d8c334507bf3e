"""Cap-tokens: issuance and verification (service), the key ring (keys), the auth dependency, the HTTP routes."""
