"""fusedrl.config"""
