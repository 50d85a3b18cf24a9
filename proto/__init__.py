"""The wire: .proto files, their generated modules, and the tensor codec. Imports nothing of ours."""
