"""The admin console at ``/console``: the registry read in a browser, server-rendered (docs/console.md)."""
