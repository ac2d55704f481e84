"""fusedrl.bench"""
