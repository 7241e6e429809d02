"""Config schema, Serve application builder and command line.

Wires everything together.
"""
