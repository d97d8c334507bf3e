"""Wire types: the request and response bodies of the protocol, shared by the store and its clients.

Pydantic v2 models only (no FastAPI, SQLAlchemy or boto3): the server imports
them to parse and answer, a client to build and read.
"""
