"""fusedrl.pipelining"""
