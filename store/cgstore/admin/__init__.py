"""Admin views: what the registry holds, who publishes, what was refused, what is unhealthy."""
