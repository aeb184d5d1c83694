"""Security: the cluster's certificates (`certs`), mutual TLS (`tls`), who may call
what (`access`) and the tenants' secret cache salts (`tenants`)."""
