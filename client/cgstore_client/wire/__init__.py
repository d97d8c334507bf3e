"""Wire types of the protocol: request and response bodies, shared by the store and its client.

The store's routers use these as FastAPI request/response models (so the
served OpenAPI schema is exactly these types); the client parses answers with
them. pydantic v2 only: nothing here imports FastAPI, SQLAlchemy or boto3.
"""
