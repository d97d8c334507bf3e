"""Regional mirrors: a store with an upstream serves its region and pulls each record and blob once, verified."""
