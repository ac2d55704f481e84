"""fusedrl.generation"""
