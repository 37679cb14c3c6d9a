"""zeroplan: will it fit, with which sharding, and what will it cost in communication?"""
