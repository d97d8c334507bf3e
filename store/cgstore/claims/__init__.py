"""Claims: one mint per declaration across a fleet (issue 26 §1).

A worker that misses claims its declaration in the repo it will publish to;
the store grants one claimer per declaration at a time, tells the others who
holds it, backs off after failures, and stops granting a declaration that keeps
failing until an admin clears it.
"""
