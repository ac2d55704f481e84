"""fusedrl.components"""
