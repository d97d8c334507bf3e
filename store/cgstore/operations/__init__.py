"""Operations: leases that make one replica at a time run each background task, and garbage collection."""
